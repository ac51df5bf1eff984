"""Run vLLM's flash-linear-attention (GDN) Triton ops on CPU with Triton's interpreter.

``load_fla`` writes the ops package of a (patched) tree to a directory under a package name of
the caller's choosing (so a pristine and a patched copy load side by side) and imports its
``chunk`` module through ``ci/fla_ops.py`` (shared with ``ci/gpu_p103.py``): stand-ins for the
vLLM modules the ops import (a platform that is neither CUDA nor ROCm here), the first config of
each ``@triton.autotune``, and the three gaps of the interpreter these kernels reach, bridged
(that module's docstring says which and how). Call it in a process with ``TRITON_INTERPRET=1``
set before anything imports Triton. bfloat16 is computed wrongly by the interpreter (its numpy
emulation), so callers use float16.
"""

from __future__ import annotations

import os
from pathlib import Path

import fla_ops  # ci/fla_ops.py: stdlib, torch and Triton only (ci/ is on the path: tests/__init__.py)

OPS = "third_party/flash_linear_attention/ops"
FILES = (
    "chunk", "chunk_delta_h", "chunk_o", "chunk_scaled_dot_kkt", "cumsum", "index", "l2norm", "op",
    "solve_tril", "utils", "wy_fast",
)


def ops_files(read) -> dict[str, str]:
    """rel path -> text of the ops ``chunk`` needs, read with ``read(rel)`` from a tree."""
    return {f"{OPS}/{name}.py": read(f"{OPS}/{name}.py") for name in FILES}


def load_fla(files: dict[str, str], where: Path, package: str):
    """The ``chunk`` module of ``files`` (rel path -> text) imported as ``<package>.chunk``."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before loading kernels"
    root = where / package
    root.mkdir(parents=True, exist_ok=True)
    (root / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / Path(rel).name).write_text(text)  # real files: Triton reads kernel source through inspect
    return fla_ops.load_chunk(where, package, cuda=False)
