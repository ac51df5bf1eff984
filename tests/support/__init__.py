"""What several test packages share: the real registry and its fixtures, the fault proxy,
build subprocesses, reliability checks, and test-only image definitions (``images/``).

Test-only definitions exist for unit-level checks on a small vLLM-shaped base; end-to-end,
reproducibility and benchmark runs use the shipped ``images/*.toml``.
"""

from pathlib import Path

TEST_IMAGES = Path(__file__).parent / "images"


def podman_store_dir(prefix: str) -> Path:
    """A new directory for a podman store (``root/``, ``run/``): in ``$TMPDIR`` when its runroot
    stays under the 50 characters podman accepts, else in ``/tmp`` (ci/test's scratch on tmpfs,
    ``/dev/shm/kiln-ci.XXXXXX/tmp``, leaves little room)."""
    import tempfile

    store = Path(tempfile.mkdtemp(prefix=prefix))
    if len(str(store / "run")) < 50:
        return store
    store.rmdir()
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
