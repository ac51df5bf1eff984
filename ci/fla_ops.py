"""vLLM's flash-linear-attention (GDN) ops imported on their own, outside vLLM, on a GPU or on CPU.

Used by ``ci/gpu_p103.py`` (a bundle's ops on a GPU machine with no vLLM; its CPU test runs it
under Triton's interpreter) and ``tests/patchsets/support/fla_interpret.py`` (P103's own test).
Standard library, torch and Triton only: the GPU machine has no kiln dependencies.

    load_chunk(where, package, cuda)   import ``<package>.chunk`` from ``where/<package>/`` (a copy of
                                       ``vllm/third_party/flash_linear_attention/ops``)

It first puts in ``sys.modules`` stand-ins for the vLLM modules the ops import:
``vllm.triton_utils`` (the real ``triton``, ``tl`` and libdevice), ``vllm.platforms`` (a CUDA
platform when ``cuda``, else one that is neither CUDA nor ROCm), ``vllm.utils.gpu_sync_debug``
(``gpu_sync_allowed`` as a no-op context) and ``vllm.utils.torch_utils`` (``async_tensor_h2d`` as
a plain copy). Each ``@triton.autotune`` takes its first config (vLLM's
``VLLM_TRITON_FORCE_FIRST_CONFIG`` does the same), so two copies of the ops run identical kernels.

Under Triton's interpreter (``TRITON_INTERPRET=1``, set before anything imports Triton) it bridges
three gaps of the interpreter (Triton 3.7) that these kernels reach, none of which changes what a
kernel computes:
- ``@triton.autotune``: the interpreter would benchmark every config through a GPU driver there is
  none of; the first config only (above) avoids it.
- ``for i_t in range(NT)``: a compiled kernel's loop variable is a tensor (``i_t.to(...)`` in
  ``chunk_delta_h.py``), the interpreter's a Python int; the loop variable is rebound to a
  tensor at the top of each iteration, as the interpreter already does for every assignment.
- ``exp = tl.exp`` aliases (``ops/op.py``): the interpreter patches the builtins on ``tl``'s
  modules only, so each alias forwards to the patched builtin at call time.
bfloat16 is computed wrongly by the interpreter (its numpy emulation): callers use float16.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import sys
import types
from pathlib import Path


class _Platform:
    """``vllm.platforms.current_platform``: CUDA or not; every other ``is_*`` question is no."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def is_cuda_alike(self) -> bool:
        return self.cuda

    def is_cuda(self) -> bool:
        return self.cuda

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda *a, **k: False
        raise AttributeError(name)


def _async_tensor_h2d(data, device=None, dtype=None, **_):
    """vLLM's ``async_tensor_h2d`` without pinned memory: a list, array or tensor to ``device``."""
    import torch

    return torch.as_tensor(data, dtype=dtype).to(device=device, dtype=dtype)


def _stand_ins(cuda: bool) -> None:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    modules = {
        "vllm": {}, "vllm.utils": {},
        "vllm.triton_utils": {"triton": triton, "tl": tl, "tldevice": tldevice},
        "vllm.platforms": {"current_platform": _Platform(cuda)},
        "vllm.utils.gpu_sync_debug": {"gpu_sync_allowed": contextlib.nullcontext},
        "vllm.utils.torch_utils": {"async_tensor_h2d": _async_tensor_h2d},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module


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


def load_chunk(where: Path, package: str, cuda: bool):
    """``<package>.chunk`` imported from ``where/<package>/`` (the ops files, real files: Triton
    reads kernel source through ``inspect``), with the stand-ins; bridged when interpreted."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        _loop_variables_as_tensors()
    _first_config_only()
    _stand_ins(cuda)
    if package not in sys.modules:  # the package from its folder, by path: sys.path stays as it was
        folder = where / package
        spec = importlib.util.spec_from_file_location(package, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
    chunk = importlib.import_module(f"{package}.chunk")
    if interpreted:
        for name, module in list(sys.modules.items()):
            if name.startswith(f"{package}."):
                _forward_builtin_aliases(module)
    return chunk
