"""Run vLLM's flash-linear-attention (GDN) Triton ops on CPU with Triton's interpreter.

``load_fla`` writes the ops package of a (patched) tree to a directory under a package name of
the caller's choosing (so a pristine and a patched copy load side by side) and imports its
``chunk`` module, with stand-ins for the vLLM modules the ops import: ``vllm.triton_utils`` (the
real ``triton``, ``tl`` and libdevice), ``vllm.platforms`` (a platform that is neither CUDA nor
ROCm), ``vllm.utils.gpu_sync_debug`` (``gpu_sync_allowed`` as a no-op context) and
``vllm.utils.torch_utils`` (``async_tensor_h2d`` of a list, array or tensor as a plain copy).
Call it in a process with ``TRITON_INTERPRET=1`` set before anything imports Triton.

Three gaps of the interpreter (Triton 3.7) that these kernels reach, and what ``load_fla`` does
about each, none of which changes what a kernel computes:
- ``@triton.autotune``: the interpreter benchmarks every config through a GPU driver there is
  none of; the first config is taken, as vLLM's ``VLLM_TRITON_FORCE_FIRST_CONFIG`` does.
- ``for i_t in range(NT)``: a compiled kernel's loop variable is a tensor (``i_t.to(...)`` in
  ``chunk_delta_h.py``), the interpreter's a Python int; the loop variable is rebound to a
  tensor at the top of each iteration, as the interpreter already does for every assignment.
- ``exp = tl.exp`` aliases (``ops/op.py``): the interpreter patches the builtins on ``tl``'s
  modules only, so each alias forwards to the patched builtin at call time.
bfloat16 is computed wrongly by the interpreter (its numpy emulation), so callers use float16.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import sys
import types
from pathlib import Path

OPS = "third_party/flash_linear_attention/ops"
FILES = (
    "chunk", "chunk_delta_h", "chunk_o", "chunk_scaled_dot_kkt", "cumsum", "index", "l2norm", "op",
    "solve_tril", "utils", "wy_fast",
)


def ops_files(read) -> dict[str, str]:
    """rel path -> text of the ops ``chunk`` needs, read with ``read(rel)`` from a tree."""
    return {f"{OPS}/{name}.py": read(f"{OPS}/{name}.py") for name in FILES}


def _first_config_only() -> None:
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner, "_kiln_first_config", False):
        return
    run = Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    Autotuner.run = first_config
    Autotuner._kiln_first_config = True


def _loop_variables_as_tensors() -> None:
    from triton.runtime import interpreter

    def visit_For(self, node):
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            rebind = ast.Assign(targets=[ast.Name(node.target.id, ast.Store())], value=ast.Name(node.target.id, ast.Load()))
            rebind = ast.fix_missing_locations(ast.copy_location(rebind, node))
            node.body.insert(0, self.visit_Assign(rebind))
        return node

    interpreter.ASTTransformer.visit_For = visit_For


def _forward_builtin_aliases(module) -> None:
    import triton.language as tl

    for name, member in list(vars(module).items()):
        if callable(member) and tl.core.is_builtin(member):
            owner = sys.modules[member.__module__]

            def forward(*args, _owner=owner, _name=member.__name__, **kwargs):
                return getattr(_owner, _name)(*args, **kwargs)

            setattr(module, name, forward)


def _async_tensor_h2d(data, device=None, dtype=None):
    """vLLM's ``async_tensor_h2d`` without pinned memory: a list, array or tensor to ``device``."""
    import torch

    return torch.as_tensor(data, dtype=dtype).to(device=device, dtype=dtype)


def _stand_ins() -> None:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    platform = types.SimpleNamespace(is_cuda_alike=lambda: False, is_rocm=lambda: False)
    modules = {
        "vllm": {},
        "vllm.triton_utils": {"triton": triton, "tl": tl, "tldevice": tldevice},
        "vllm.platforms": {"current_platform": platform},
        "vllm.utils": {},
        "vllm.utils.gpu_sync_debug": {"gpu_sync_allowed": contextlib.nullcontext},
        "vllm.utils.torch_utils": {"async_tensor_h2d": _async_tensor_h2d},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module


def load_fla(files: dict[str, str], where: Path, package: str):
    """The ``chunk`` module of ``files`` (rel path -> text) imported as ``<package>.chunk``."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before loading kernels"
    _first_config_only()
    _loop_variables_as_tensors()
    _stand_ins()
    root = where / package
    root.mkdir(parents=True, exist_ok=True)
    (root / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / Path(rel).name).write_text(text)  # real files: Triton reads kernel source through inspect
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    chunk = importlib.import_module(f"{package}.chunk")
    for name, module in list(sys.modules.items()):
        if name.startswith(f"{package}."):
            _forward_builtin_aliases(module)
    return chunk
