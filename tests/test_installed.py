"""kiln installed, not editable: it runs from its package alone, with no checkout's ``ci/`` in reach.

kiln is installed with pip (``--no-deps --no-build-isolation --target DIR``: the wheel setuptools
builds from pyproject.toml's package data, nothing from the network) from a copy of what its
wheel is built from, then run from a directory outside any checkout with ``PYTHONPATH=DIR`` (its
dependencies: this interpreter's own). ``values`` is asked of a shipped image against a
registry stand-in (a mirror for ghcr.io serving the image's manifest): both charts' values come
out, with kiln's schemas read from the installed package.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import jsonschema
import pytest

from kiln import labels as L
from kiln import paths

pytestmark = pytest.mark.isolated

IMAGE, PIN, SM = "qwen3.6-27b-tq", "v0.33.0", 120
TAG = f"cu130-sm{SM}-{PIN}"
MANIFEST = json.dumps({
    "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + "1" * 64, "size": 2},
    "layers": [], "annotations": {L.IMAGE: IMAGE, L.PIN: PIN, L.SM: str(SM)},
}).encode()
DIGEST = "sha256:" + hashlib.sha256(MANIFEST).hexdigest()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """DIR holding kiln as pip installs it (not editable)."""
    base = tmp_path_factory.mktemp("installed")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(paths.REPO / name, source / name)
    shutil.copytree(paths.REPO / "kiln", source / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
    target = base / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        cwd=base, capture_output=True, text=True, timeout=600,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (target / "kiln" / "schemas" / "helm" / "vllm-stack" / "values.schema.json").is_file()
    assert not (target / "ci").exists()
    return target


@pytest.fixture(scope="module")
def registry():
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, body: bool):
            if self.path == f"/v2/you/x/manifests/{TAG}":
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
                self.send_header("Docker-Content-Digest", DIGEST)
                self.send_header("Content-Length", str(len(MANIFEST)))
                self.end_headers()
                if body:
                    self.wfile.write(MANIFEST)
                return
            code, text = (200, b"{}") if self.path == "/v2/" else (404, b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}')
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            if body:
                self.wfile.write(text)

        def do_GET(self):  # noqa: N802
            self._answer(True)

        def do_HEAD(self):  # noqa: N802
            self._answer(False)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("chart", ["kiln", "vllm-stack"])
def test_an_installed_kiln_writes_values_with_no_ci_directory(installed, registry, tmp_path, chart):
    # the data a user passes (pins, definitions, catalogue), in a directory with no ci/ in it or above
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy2(paths.PINS, data / "pins.toml")
    shutil.copytree(paths.IMAGES, data / "images")
    shutil.copytree(paths.PATCHSETS, data / "patchsets", ignore=shutil.ignore_patterns("__pycache__"))
    assert not any(parent.joinpath("ci").exists() for parent in (data, *data.parents))
    assert not any(parent.joinpath("ci").exists() for parent in (installed, *installed.parents))
    program = ("import sys, kiln, kiln.commands; print(kiln.__file__, file=sys.stderr); "
               "sys.exit(kiln.commands.main(sys.argv[1:]))")
    argv = [sys.executable, "-c", program,
            "--pins", str(data / "pins.toml"), "--images", str(data / "images"),
            "--patchsets", str(data / "patchsets"), "--record", str(data / "patchsets" / "verdicts.toml"),
            "values", "--image", IMAGE, "--pin", PIN, "--sm", str(SM), "--repository", "ghcr.io/you/x",
            "--mirror", f"ghcr.io=http://{registry}", "--chart", chart]
    env = {**os.environ, "PYTHONPATH": str(installed), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(argv, cwd=data, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    where = Path(done.stderr.splitlines()[0])
    assert where.is_relative_to(installed), where  # the installed kiln ran, not the checkout's
    values = json.loads(done.stdout)
    schemas = installed / "kiln" / "schemas" / "helm"
    schema = schemas / ("values.schema.json" if chart == "kiln" else "vllm-stack/values.schema.json")
    jsonschema.Draft202012Validator(json.loads(schema.read_text())).validate(values)
    if chart == "kiln":
        assert values["image"] == {"repository": "ghcr.io/you/x", "tag": TAG, "digest": DIGEST,
                                   "pullPolicy": "IfNotPresent"}
        assert values["kiln"] == {"image": IMAGE, "pin": PIN, "vllm": "0.33.0", "sm": SM}
    else:
        (spec,) = values["servingEngineSpec"]["modelSpec"]
        assert (spec["repository"], spec["tag"]) == ("ghcr.io/you/x", f"{TAG}@{DIGEST}")
