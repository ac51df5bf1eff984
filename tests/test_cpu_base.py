"""ci/cpu/base.py: its Debian step against a mirror that fails (retried, then one line saying
why), and its work folder safe from kiln's own clean-up of the cache it builds in.

The mirror is a real HTTP server on 127.0.0.1 answering 503 to everything, and the step runs the
real mmdebstrap (which CI installs, ci/test): apt's own error must reach the line, not only
mmdebstrap's last words ("apt-get update ... failed"), which is all a red CI run showed once.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base():
    spec = importlib.util.spec_from_file_location("kiln_ci_cpu_base", REPO / "ci" / "cpu" / "base.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def unavailable_mirror():
    paths: list[str] = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            paths.append(self.path)
            self.send_response(503, "Service Unavailable")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/debian", paths
    server.shutdown()
    server.server_close()


def test_a_mirror_that_keeps_failing_is_tried_again_then_named_in_one_line(base, unavailable_mirror, tmp_path,
                                                                           monkeypatch, capsys):
    url, paths = unavailable_mirror
    monkeypatch.setattr(base, "MIRRORS", [f"deb {url} {base.SUITE} main"])
    with pytest.raises(base.RecipeError) as raised:
        base.debian_root(tmp_path / "root", attempts=2, pause=0)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("mmdebstrap")
    assert "503" in message and url.split("//")[1] in message, message  # apt's own line, naming the mirror
    log = capsys.readouterr().err
    assert log.count("attempt 1 of 2 failed, again in 0 s") == 1 and "attempt 2" not in log
    # both attempts asked the mirror for the suite's index: each is a run of its own
    index = f"/debian/dists/{base.SUITE}/InRelease"
    assert paths.count(index) >= 2, paths


def test_apt_errors_are_the_reason_given_and_other_output_only_without_them(base):
    apt = ("I: chroot architecture amd64\nErr:1 http://m/debian bookworm InRelease\n  503  Service Unavailable\n"
           "W: Failed to fetch http://m/debian/dists/bookworm/InRelease  503  Service Unavailable\n"
           "E: apt-get update --error-on=any failed\nE: mmdebstrap failed to run\n")
    assert base.why(apt) == ("Err:1 http://m/debian bookworm InRelease | W: Failed to fetch "
                             "http://m/debian/dists/bookworm/InRelease  503  Service Unavailable | "
                             "E: apt-get update --error-on=any failed | E: mmdebstrap failed to run")
    assert base.why("WARNING: ignored\nfirst\nsecond\nthird\n") == "second | third"
    assert len(base.why("E: " + "x" * 5000)) == 2000


def test_the_recipe_holds_kilns_cache_so_a_kiln_process_leaves_its_work_folder_alone(base, tmp_path):
    """ci/test builds the base beside pytest, whose kiln processes come and go on the same cache:
    the first to find the cache unused removes every ``.tmp-*`` entry as a dead process's."""
    cache = tmp_path / "cache"
    work = cache / "cpu-base" / ".tmp-recipe"
    claim = [sys.executable, "-c", "import sys; from pathlib import Path; from kiln.cache import claim_cache; "
                                   "claim_cache(Path(sys.argv[1]))", str(cache)]
    held = base.hold_cache(cache)
    work.mkdir(parents=True)
    subprocess.run(claim, check=True, timeout=60)
    assert work.is_dir(), "a kiln process removed the recipe's work folder while the recipe held the cache"
    os.close(held)  # the recipe gone: its folder is a leftover, and the next kiln process removes it
    subprocess.run(claim, check=True, timeout=60)
    assert not work.exists()
