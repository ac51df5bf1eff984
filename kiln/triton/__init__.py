"""Ahead-of-time Triton kernel caches for an image (see docs/TRITON.md).

    kernels.py    the kernel preset an image declares, the launchers kiln knows, the launch plan
    toolchain.py  the Triton the base image carries, installed from PyPI (or kiln's own)
    worker.py     the compile/check process: stand-in driver, stand-in vLLM modules, real launchers
    aot.py        one process per SM, the fresh-process self-check, kiln-cache entries, layer files
"""
