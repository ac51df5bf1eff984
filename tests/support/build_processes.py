"""``build.py build`` as a real OS process, and a checker for the cache it leaves behind.

Used by the concurrency and crash tests: builds there run as separate processes (as two CI jobs
sharing a cache would), so locks, renames and SIGKILL behave as they do in production.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support import TEST_IMAGES
from tests.support.registry import REPO, VLLM_VERSION
from tests.support.reliability_checks import assert_cache_verified

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "e2e-p65"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@dataclass
class Workspace:
    """Pins (the fixture base as ``v0.20.1``, its overlay variant as ``ovl``) and an image
    definition built for both, against one registry."""

    root: Path
    registry: object

    @classmethod
    def create(cls, root: Path, registry) -> Workspace:
        root.mkdir(parents=True, exist_ok=True)
        base = registry.digest_of(f"{REPO}:v{VLLM_VERSION}")
        overlay = registry.digest_of(f"{REPO}:v{VLLM_VERSION}-overlay")
        (root / "pins.toml").write_text(
            f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/{REPO}:v{VLLM_VERSION}"\n'
            f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{base}"\n\n'
            f'[pins."ovl"]\nrole = "rollback"\nimage = "docker.io/{REPO}:v{VLLM_VERSION}-overlay"\n'
            f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{overlay}"\n'
        )
        images = root / "images"
        images.mkdir(exist_ok=True)
        text = (TEST_IMAGES / f"{IMAGE}.toml").read_text()
        (images / f"{IMAGE}.toml").write_text(re.sub(r'(?m)^pins = .*$', "pins = []", text))
        return cls(root, registry)

    def argv(self, pin: str, sm: int, out: Path, dest: str) -> list[str]:
        return [sys.executable, str(ROOT / "build.py"), "--pins", str(self.root / "pins.toml"),
                "--images", str(self.root / "images"), "build", "--image", IMAGE, "--pin", pin, "--sm", str(sm),
                "--mirror", self.registry.mirror, "--json", "--oci", str(out), "--push",
                "--repository", f"{self.registry.host}/{dest}"]

    def start(self, cache: Path, pin: str, sm: int, out: Path, dest: str, pause_at: str | None = None) -> subprocess.Popen:
        env = dict(os.environ, KILN_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
        env.pop("KILN_TEST_PAUSE_AT", None)
        if pause_at:
            env["KILN_TEST_PAUSE_AT"] = pause_at
        return subprocess.Popen(self.argv(pin, sm, out, dest), cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def run(self, cache: Path, pin: str, sm: int, out: Path, dest: str) -> dict:
        return finish(self.start(cache, pin, sm, out, dest))


def finish(process: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out)


def wait_for_pause(process: subprocess.Popen, phase: str, timeout: float = 300) -> None:
    """Read stderr until the build says it paused at ``phase`` (then it sleeps until killed)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            raise AssertionError(f"build ended before pausing at {phase}: {''.join(seen)[-3000:]}")
        seen.append(line)
        if line.strip() == f"kiln: paused at {phase}":
            return
    raise AssertionError(f"no pause at {phase} within {timeout}s")


def tag_digest(registry, repository: str, tag: str) -> str | None:
    resp = requests.head(f"{registry.url}/v2/{repository}/manifests/{tag}", headers={"Accept": OCI_MANIFEST}, timeout=10)
    return resp.headers.get("Docker-Content-Digest") if resp.status_code == 200 else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_cache(cache: Path, allow_leftovers: bool = False) -> None:
    """Every entry is final and verified: blobs and manifests hash to their names, records point
    at complete trees, and (unless a process was just killed) no temporary entry is left."""
    if allow_leftovers:
        for blob in (cache / "blobs" / "sha256").glob("*"):
            if not blob.name.startswith(".tmp-"):
                assert sha256_file(blob) == blob.name, f"blob {blob.name} does not hash to its name"
    else:
        assert [p for p in cache.rglob(".tmp-*")] == []
        assert_cache_verified(cache)
    for entry in (cache / "manifests").glob("*"):
        if not entry.name.startswith(".tmp-"):
            _, _, data = entry.read_bytes().partition(b"\n")
            assert "sha256-" + hashlib.sha256(data).hexdigest() == entry.name
    for record_path in (cache / "images").glob("*.json"):
        record = json.loads(record_path.read_text())
        root = Path(record["tree"]["root"])
        assert root.is_relative_to(cache / "sources") and (root / "vllm" / "__init__.py").is_file()
        for rel in record["vllm_files"]:
            if rel.endswith(".py"):
                assert (root / "vllm" / rel).is_file(), f"{record_path.name}: {rel} missing from {root}"


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file below ``root`` (to compare two extracted trees)."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def source_trees(cache: Path) -> dict[str, dict[str, str]]:
    return {p.name: tree_digest(p) for p in sorted((cache / "sources").glob("image-*"))}


def layout_digest(out: Path) -> str:
    """The manifest digest an OCI layout's index names (after checking every blob hashes right)."""
    index = json.loads((out / "index.json").read_text())
    for blob in (out / "blobs" / "sha256").iterdir():
        assert sha256_file(blob) == blob.name
    [entry] = [m for m in index["manifests"] if "artifactType" not in m]  # the rest: SBOM, provenance
    return entry["digest"]
