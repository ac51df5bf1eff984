"""How the Triton kernel worker keys its cache entries for the image's own Triton rather than the
toolchain's: standard library only, loaded by ``worker.py`` from its folder (as ``worker_keys``).

Public API:
    key_for_image(key_libtriton)   ``triton_key()`` with the image's libtriton.so sha256 for ours
    ptxas_for_image(key_ptxas)     the backend's ``hash()`` with the image's ptxas text for ours

Its text is part of every entry's key (``aot._entry_key``): a change here re-keys the caches.
"""

from __future__ import annotations


def key_for_image(key_libtriton: dict | None) -> None:
    """Make ``triton_key()`` what the image's Triton computes: its libtriton.so hash for ours."""
    if not key_libtriton:
        return
    from triton.runtime import autotuner, cache

    own, image = key_libtriton["own"], key_libtriton["image"]
    key = cache.triton_key()
    if key.count(own) != 1:  # a Triton that hashes libtriton.so differently: nothing to replace safely
        raise RuntimeError(f"triton_key() does not hold libtriton.so's sha256 {own} exactly once")
    image_key = key.replace(own, image)

    def triton_key():
        return image_key

    cache.triton_key = triton_key  # get_cache_key reads the module global
    autotuner.triton_key = triton_key  # imported by name there


def ptxas_for_image(key_ptxas: dict | None) -> None:
    """Make the backend's ``hash()`` what the image's Triton computes on another machine: the text
    its ptxas prints for ``--version`` (``kiln/triton/platformwheel.py``) for what ours prints. The
    compile itself still runs our ptxas (the same release and build, for this machine)."""
    if not key_ptxas:
        return
    from triton.backends.nvidia import compiler

    real = compiler.get_ptxas_version

    def get_ptxas_version(*args, **kwargs):
        own = real(*args, **kwargs)
        if own not in key_ptxas:
            raise RuntimeError(f"ptxas --version printed {own!r}, which the job does not key for the image")
        return key_ptxas[own]

    compiler.get_ptxas_version = get_ptxas_version  # CUDABackend.hash reads the module global
