"""A killed process's temporary cache entries are removed by the next user -- only when no other
process is using the cache (their temporary entries may be live); an entry being filled is judged
by its own flock, a stage by its owner's pid and start time."""

from __future__ import annotations

import os
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


HOLD_LOCK = "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); " \
            "print('locked', flush=True); time.sleep(60)"


@pytest.mark.parametrize("finished", [True, False], ids=["entry-exists", "entry-missing"])
def test_a_killed_fill_is_removed_under_its_lock_even_while_the_cache_is_in_use(tmp_path, finished):
    """``install_dir``: a ``.tmp-<name>-*`` beside an entry belongs to a dead process once its flock
    is free, whatever lock file lies there and whoever else uses the cache (``claim_cache`` would
    keep it then), and in a directory no cache claim covers ($KILN_TRITON_TOOLCHAINS)."""
    from kiln.cache import install_dir

    root = tmp_path / "toolchains"
    final = root / "triton-3.6.0"
    dead = root / ".tmp-triton-3.6.0-ab12cd_9"  # mkdtemp's name, as a killed fetch left it
    (dead / "triton").mkdir(parents=True)
    (dead / "triton" / "libtriton.so").write_bytes(b"half a wheel")
    other = root / ".tmp-triton-3.6.0rc1-ab12cd_9"  # another entry's: not this one's to judge
    other.mkdir()
    (root / ".triton-3.6.0.lock").write_text("")  # a lock file left behind: it holds nothing
    if finished:
        (final / "triton").mkdir(parents=True)
    holder = claim(tmp_path / "cache", hold=60)  # another process uses the cache meanwhile
    try:
        assert install_dir(final, lambda tmp: (tmp / "triton").mkdir()) == final
    finally:
        holder.kill()
        holder.wait()
    assert not dead.exists() and other.exists() and (final / "triton").is_dir()


def test_a_fill_whose_lock_is_held_is_kept(tmp_path):
    from kiln.cache import install_dir

    final = tmp_path / "triton-3.6.0"
    (final / "triton").mkdir(parents=True)
    live = tmp_path / ".tmp-triton-3.6.0-ab12cd_9"
    live.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / ".triton-3.6.0.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        install_dir(final, lambda tmp: None)
        assert live.is_dir()
    finally:
        holder.kill()
        holder.wait()
    install_dir(final, lambda tmp: None)
    assert not live.exists()


def test_a_stage_of_a_reused_pid_is_removed(tmp_path):
    """A stage names its owner by pid and start time: a live process that got the same pid later
    does not own it; the owner itself (and a name without a start time, by pid) still does."""
    from kiln.staging import remove_dead_stages, stage_dir, start_time

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = start_time(alive.pid)
        assert start is not None
        reused = tmp_path / f".out.kiln-{alive.pid}.{int(start) - 100}-a1b2c3"  # started 1 s before it
        reused.mkdir()
        owned = tmp_path / f".out.kiln-{alive.pid}.{start}-d4e5f6"
        owned.mkdir()
        by_pid = tmp_path / f".out.kiln-{alive.pid}-g7h8i9"
        by_pid.mkdir()
        mine = stage_dir(tmp_path / "out")
        assert mine.name.startswith(f".out.kiln-{os.getpid()}.{start_time(os.getpid())}-")
        assert remove_dead_stages(tmp_path) == [reused]
        assert owned.is_dir() and by_pid.is_dir() and mine.is_dir()
    finally:
        alive.kill()
        alive.wait()
    assert sorted(remove_dead_stages(tmp_path)) == sorted([owned, by_pid])
