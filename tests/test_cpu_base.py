"""ci/cpu_base.py: its Debian step against a mirror that fails (retried, then one line saying
why), and its work folder safe from kiln's own clean-up of the cache it builds in.

The mirror is a real HTTP server on 127.0.0.1 answering 503 to everything, and the step runs the
real mmdebstrap (which CI installs, ci/test): apt's own error must reach the line, not only
mmdebstrap's last words ("apt-get update ... failed"), which is all a red CI run showed once.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base():
    spec = importlib.util.spec_from_file_location("kiln_ci_cpu_base", REPO / "ci" / "cpu_base.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(params=["apt", "index"])
def unavailable_mirror(request, base):
    """A mirror answering 503 to everything; with "apt", it serves its plain Packages index (the
    lock's packages), so the recipe's own look at the index passes and apt meets the 503."""
    paths: list[str] = []
    index = "".join(f"Package: {n}\nVersion: {v}\n\n" for n, v in base.debian_pins().items()).encode()

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            paths.append(self.path)
            if request.param == "apt" and self.path.endswith("/binary-amd64/Packages"):
                self.send_response(200)
                self.send_header("Content-Length", str(len(index)))
                self.end_headers()
                self.wfile.write(index)
                return
            if request.param == "apt" and self.path.endswith(("/Packages.xz", "/Packages.gz")):
                self.send_response(404)
            else:
                self.send_response(503, "Service Unavailable")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/debian", paths, request.param
    server.shutdown()
    server.server_close()


def test_a_mirror_that_keeps_failing_is_tried_again_then_named_in_one_line(base, unavailable_mirror, tmp_path,
                                                                           monkeypatch, capsys):
    url, paths, where = unavailable_mirror
    monkeypatch.setattr(base, "MIRRORS", [f"deb {url} {base.SUITE} main"])
    with pytest.raises(base.RecipeError) as raised:
        base.debian_root(tmp_path / "root", attempts=2, pause=0)
    message = str(raised.value)
    assert "\n" not in message
    assert "503" in message and url.split("//")[1] in message, message  # naming the mirror and its answer
    log = capsys.readouterr().err
    assert log.count("attempt 1 of 2 failed, again in 0 s") == 1 and "attempt 2" not in log
    if where == "apt":  # apt's own line, not only mmdebstrap's last words
        assert message.startswith("mmdebstrap"), message
        index = f"/debian/dists/{base.SUITE}/InRelease"
    else:  # the recipe's look at the index, before apt
        index = f"/debian/dists/{base.SUITE}/main/binary-amd64/Packages.xz"
        assert message.startswith(f"{url}{index[len('/debian'):]}: HTTP 503"), message
    # both attempts asked the mirror for the suite's index: each is a run of its own
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


# -- Debian's archive moving under the lock -----------------------------------------------------------
# Debian keeps only the newest version of each package: a lock of exact versions goes stale at each
# point or security release. The recipe then builds from what Debian serves, with one warning line,
# and fails (before fetching anything) only when a locked package is gone altogether. The mirror
# here is a real directory served on 127.0.0.1, made of the packages Debian serves today for the
# lock's names, with one of them rebuilt as a newer version: what Debian's next update looks like.

def _stanzas(base, line: str) -> dict[str, dict]:
    """Each package of a mirror's index (a ``deb URL SUITE COMPONENT`` line): its newest stanza."""
    url, suite, components = base.mirror_source(line)
    newest: dict[str, dict] = {}
    for component in components:
        index = f"{url}/dists/{suite}/{component}/binary-amd64/Packages.xz"
        text = base.unpacked(index, base.httpread.get(index, max_bytes=base.INDEX_MAX_BYTES, deadline=base.INDEX_SECONDS).body).decode()
        for fields in base.control_stanzas(text):
            if "Package" in fields and _outranks(fields, newest.get(fields["Package"])):
                newest[fields["Package"]] = dict(fields, _url=url)
    return newest


def _outranks(stanza: dict, held: dict | None) -> bool:
    """Whether ``stanza`` is a newer version than ``held`` (none held: yes), by dpkg's ordering."""
    return held is None or subprocess.run(["dpkg", "--compare-versions", stanza["Version"], "gt", held["Version"]],
                                          check=False).returncode == 0


def _write_index(root: Path, stanzas: list[dict]) -> None:
    import hashlib
    import lzma

    order = ["Package", "Source", "Version", "Installed-Size", "Maintainer", "Architecture", "Replaces",
             "Provides", "Depends", "Pre-Depends", "Recommends", "Suggests", "Breaks", "Conflicts",
             "Description", "Multi-Arch", "Essential", "Protected", "Section", "Priority", "Filename", "Size",
             "MD5sum", "SHA256"]
    text = "\n".join("".join(f"{k}: {s[k]}\n" for k in order if k in s) for s in stanzas) + "\n"
    folder = root / "dists" / "bookworm" / "main" / "binary-amd64"
    folder.mkdir(parents=True)
    (folder / "Packages").write_text(text)
    (folder / "Packages.xz").write_bytes(lzma.compress(text.encode()))
    files = [(p.relative_to(root / "dists" / "bookworm").as_posix(), p.read_bytes()) for p in sorted(folder.iterdir())]
    (root / "dists" / "bookworm" / "Release").write_text(
        "Origin: kiln-test\nLabel: kiln-test\nSuite: bookworm\nCodename: bookworm\n"
        "Date: Thu, 01 Jan 2026 00:00:00 UTC\nArchitectures: amd64\nComponents: main\nSHA256:\n"
        + "".join(f" {hashlib.sha256(data).hexdigest()} {len(data)} {name}\n" for name, data in files))


@pytest.fixture(scope="module")
def debian_today(base, tmp_path_factory):
    """The newest stanza and .deb of each locked package, as Debian serves them today."""
    import hashlib
    import urllib.request

    folder = tmp_path_factory.mktemp("debian-today")
    newest: dict[str, dict] = {}
    for line in base.MIRRORS:
        for name, stanza in _stanzas(base, line).items():
            if _outranks(stanza, newest.get(name)):
                newest[name] = stanza
    pins = base.debian_pins()
    chosen = {name: newest[name] for name in pins if name in newest}
    assert len(chosen) == len(pins), f"Debian serves none of {sorted(set(pins) - set(chosen))}"
    for stanza in chosen.values():
        data = urllib.request.urlopen(f"{stanza['_url']}/{stanza['Filename']}", timeout=120).read()
        assert hashlib.sha256(data).hexdigest() == stanza["SHA256"], stanza["Filename"]
        deb = folder / Path(stanza["Filename"]).name
        deb.write_bytes(data)
        stanza["_deb"] = deb
    return chosen


def _mirror(tmp: Path, stanzas: dict[str, dict]) -> Path:
    """A mirror tree (pool/ and dists/bookworm/) holding the given stanzas' packages."""
    root = tmp / "mirror"
    (root / "pool").mkdir(parents=True)
    written = []
    for stanza in stanzas.values():
        deb = Path(stanza["_deb"])
        target = root / "pool" / deb.name
        target.symlink_to(deb)
        written.append({k: v for k, v in stanza.items() if not k.startswith("_")} | {"Filename": f"pool/{deb.name}"})
    _write_index(root, written)
    return root


def _newer(stanza: dict, tmp: Path) -> dict:
    """The same package rebuilt one version up (what a Debian update ships): control's Version
    raised, the .deb built again, its size and hashes in the stanza."""
    import hashlib

    tree = tmp / f"{stanza['Package']}-tree"
    subprocess.run(["dpkg-deb", "-R", str(stanza["_deb"]), str(tree)], check=True)
    control = tree / "DEBIAN" / "control"
    version = stanza["Version"] + "+kiln1"
    control.write_text(control.read_text().replace(f"Version: {stanza['Version']}\n", f"Version: {version}\n"))
    deb = tmp / f"{stanza['Package']}_{version.replace(':', '%3a')}_newer.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zxz", "-b", str(tree), str(deb)], check=True,
                   capture_output=True)
    data = deb.read_bytes()
    return dict(stanza, Version=version, Size=str(len(data)), SHA256=hashlib.sha256(data).hexdigest(),
                MD5sum=hashlib.md5(data).hexdigest(), _deb=deb)


@pytest.fixture
def recipe_copy(tmp_path):
    """The recipe in a ci/ of its own (its locks in ci/cpu/, returned), so a test can give it another lock."""
    folder = tmp_path / "ci" / "cpu"
    folder.mkdir(parents=True)
    for name in ("requirements.lock", "debian-packages.lock"):
        (folder / name).write_bytes((REPO / "ci" / "cpu" / name).read_bytes())
    for name in ("cpu_base.py", "httpread.py"):  # the recipe, and its reads beside it
        (folder.parent / name).write_bytes((REPO / "ci" / name).read_bytes())
    return folder


def _serve(root: Path):
    import functools

    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, fmt, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, requests


def _lock(folder: Path, versions: dict[str, str]) -> None:
    (folder / "debian-packages.lock").write_text("".join(f"{n}={v}\n" for n, v in sorted(versions.items())))


@pytest.mark.network
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mmdebstrap"), reason="needs root and mmdebstrap (ci/test)")
def test_a_debian_update_builds_the_root_from_what_debian_serves_with_one_warning(debian_today, recipe_copy,
                                                                                  tmp_path):
    moved = "libnuma1"  # any locked package: Debian's next update, here
    stanzas = dict(debian_today, **{moved: _newer(debian_today[moved], tmp_path)})
    server, requests = _serve(_mirror(tmp_path, stanzas))
    _lock(recipe_copy, {n: s["Version"] for n, s in debian_today.items()})
    line = f"deb [trusted=yes] http://127.0.0.1:{server.server_port}/ bookworm main"
    try:
        done = subprocess.run([sys.executable, str(recipe_copy.parent / "cpu_base.py"), "--debian-only", "--json",
                               "--attempts", "1", "--mirror", line], capture_output=True, text=True, timeout=900)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    old, new = debian_today[moved]["Version"], stanzas[moved]["Version"]
    assert record["moved"] == {moved: [old, new]}, record["moved"]
    assert record["root"][moved] == new and record["lock"][moved] == old
    warnings = [w for w in done.stderr.splitlines() if "warning:" in w]
    assert len(warnings) == 1, warnings
    assert f"{moved} {old} -> {new}" in warnings[0] and "Debian serves 1 package at other versions" in warnings[0]
    fetched = {urllib.parse.unquote(r) for r in requests}
    assert f"/pool/{Path(stanzas[moved]['_deb']).name}" in fetched, requests  # the newer .deb is the one installed


@pytest.mark.network
def test_a_locked_package_debian_no_longer_serves_fails_in_one_line_before_any_fetch(debian_today, recipe_copy,
                                                                                    tmp_path):
    gone = "libnuma1"
    server, requests = _serve(_mirror(tmp_path, {n: s for n, s in debian_today.items() if n != gone}))
    _lock(recipe_copy, {n: s["Version"] for n, s in debian_today.items()})
    line = f"deb [trusted=yes] http://127.0.0.1:{server.server_port}/ bookworm main"
    try:
        done = subprocess.run([sys.executable, str(recipe_copy.parent / "cpu_base.py"), "--debian-only", "--attempts", "1",
                               "--mirror", line],
                              capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2
    errors = [e for e in done.stderr.splitlines() if e.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert f"{gone}={debian_today[gone]['Version']}" in errors[0] and "no longer served" in errors[0], errors[0]
    assert "attempt" not in done.stderr  # not a mirror's hiccup: never tried again
    # only the index was read: no apt run, no package fetched
    assert requests and all("/dists/bookworm/main/binary-amd64/Packages" in r for r in requests), requests


def _layout_with_status(folder: Path, status: str) -> Path:
    """An OCI layout whose first layer holds ``var/lib/dpkg/status``, as the recipe's Debian layer does."""
    import gzip
    import hashlib
    import io
    import tarfile

    blobs = folder / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}"

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = status.encode()
        info = tarfile.TarInfo("./var/lib/dpkg/status")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    layer = blob(gzip.compress(raw.getvalue(), mtime=0))
    manifest = blob(json.dumps({"schemaVersion": 2, "layers": [{"digest": layer}]}).encode())
    (folder / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"digest": manifest, "annotations": {"org.opencontainers.image.ref.name": "base"}}]}))
    return folder


def test_a_cached_base_is_compared_with_the_lock_from_its_own_dpkg_status_not_a_record(base, recipe_copy,
                                                                                    tmp_path, monkeypatch):
    """The serve check decides from this whether the pinned digest must hold: it reads the base's
    own Debian layer, so a cache entry's record cannot say the root moved when it did not."""
    status = ("Package: libfoo1\nStatus: install ok installed\nVersion: 1.0-2\n\n"
              "Package: bar\nStatus: install ok installed\nArchitecture: all\nVersion: 2:3.1\n\n"
              "Package: gone\nStatus: deinstall ok config-files\nVersion: 0.9\n")
    layout = _layout_with_status(tmp_path / "layout", status)
    assert base.root_packages(layout) == {"libfoo1": "1.0-2", "bar": "2:3.1"}
    _lock(recipe_copy, {"libfoo1": "1.0-1", "bar": "2:3.1", "baz": "1"})
    monkeypatch.setattr(base, "DEBIAN_LOCK", recipe_copy / "debian-packages.lock")
    (layout.parent / "done").write_text(json.dumps({"debian": {"moved": {}}}))  # a record that says otherwise
    state = base.debian_state(layout)
    assert state["moved"] == {"baz": ["1", "-"], "libfoo1": ["1.0-1", "1.0-2"]}
    line = base.moved_line(state["moved"])
    assert "\n" not in line and "baz 1 -> -" in line and "libfoo1 1.0-1 -> 1.0-2" in line
    _lock(recipe_copy, {"libfoo1": "1.0-2", "bar": "2:3.1"})
    assert base.debian_state(layout)["moved"] == {}
