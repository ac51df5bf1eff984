"""A killed process's temporary cache entries are removed by the next user -- only when no other
process is using the cache (their temporary entries may be live)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.reliability

CLAIM = "import sys, time; from pathlib import Path; from kiln.cache import claim_cache; " \
        "claim_cache(Path(sys.argv[1])); print('claimed', flush=True); time.sleep(float(sys.argv[2]))"


def claim(root, hold: float = 0.0) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", CLAIM, str(root), str(hold)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "claimed"
    return process


def leftovers(root):
    blobs, sources = root / "blobs" / "sha256", root / "sources"
    blobs.mkdir(parents=True, exist_ok=True)
    (sources / ".tmp-image-x" / "usr").mkdir(parents=True, exist_ok=True)
    (blobs / ".tmp-0123-abc").write_bytes(b"partial")
    (blobs / ("a" * 64)).write_bytes(b"final entry, never touched")
    (sources / "image-1" / "deep" / "deeper").mkdir(parents=True, exist_ok=True)
    (sources / "image-1" / "deep" / "deeper" / ".tmp-not-scanned").write_bytes(b"inside a final tree")
    return [blobs / ".tmp-0123-abc", sources / ".tmp-image-x"]


def test_leftovers_survive_while_another_process_uses_the_cache(tmp_path):
    root = tmp_path / "cache"
    holder = claim(root, hold=60)
    try:
        stale = leftovers(root)
        claim(root).wait()  # a second user: it cannot know whose entries these are
        assert all(p.exists() for p in stale)
    finally:
        holder.kill()
        holder.wait()
    claim(root).wait()  # the first user after everyone left removes them
    assert not any(p.exists() for p in stale)
    assert (root / "blobs" / "sha256" / ("a" * 64)).read_bytes() == b"final entry, never touched"
    assert (root / "sources" / "image-1" / "deep" / "deeper" / ".tmp-not-scanned").exists()
