"""The worker's stand-in torch against real (CPU) torch: same layouts, same Triton cache keys.

Whatever a stand-in tensor tells Triton's binder or vLLM's launchers (shape, strides, storage
offset, dtype, alignment of ``data_ptr``) must be what torch would tell, or the build would
cache kernels the runtime never asks for. Checked op by op, then end to end: the worker
compiles vLLM 0.20.1's launchers on both and the kernels' Triton hashes (which cover the
pointer dtypes, the 16-byte alignment and integer specialisation) must be equal.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch  # CPU torch, a test dependency (ci/test installs it)

from kiln.triton import aot
from kiln.triton.aot import KernelSources, compile_kernel_caches
from kiln.triton.kernels import parse_kernel_preset
from kiln.triton.toolchain import toolchain_for
from tests.support.registry import TOOLCHAIN_CACHE


@pytest.fixture(scope="module")
def st():
    spec = importlib.util.spec_from_file_location("standin_torch_under_test", aot._STANDIN_TORCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layout(t) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype), t.is_contiguous(), t.data_ptr() % 16


# each case: lib -> tensor, the same expression on torch and on the stand-in
CASES = {
    "zeros": lambda m: m.zeros(3, 5, 4, 7, dtype=m.uint8),
    "view -1": lambda m: m.zeros(3, 5, 4, 7, dtype=m.uint8).view(-1),
    "reshape": lambda m: m.empty(6, 4, 8, dtype=m.float16).reshape(24, 8),
    "slice rows": lambda m: m.zeros(8, 33, dtype=m.int32)[:3],
    "slice 4d": lambda m: m.empty(4, 6, 32, 65, dtype=m.float32)[:2, :6, :32, :],
    "slice offset": lambda m: m.empty(10, 7, dtype=m.float32)[3:],
    "int index": lambda m: m.empty(10, 7, dtype=m.float16)[2],
    "expand": lambda m: m.zeros(4, 33, dtype=m.int32)[0:1].expand(4, -1),
    "transpose": lambda m: m.eye(64, dtype=m.float32).T,
    "T contiguous": lambda m: m.eye(64, dtype=m.float32).T.contiguous(),
    "float": lambda m: m.zeros(4, 2, 64, dtype=m.float16).float(),
    "to same": lambda m: m.zeros(4, dtype=m.float32).to(m.float32),
    "norm keepdim": lambda m: m.zeros(8, 64, dtype=m.float32).norm(dim=1, keepdim=True),
    "squeeze": lambda m: m.zeros(8, 64, dtype=m.float32).norm(dim=1, keepdim=True).squeeze(1),
    "broadcast div": lambda m: m.zeros(8, 64) / (m.zeros(8, 1) + 1e-8),
    "matmul": lambda m: m.zeros(2, 6, 64, dtype=m.float32) @ m.eye(64, dtype=m.float32),
    "midpoints": lambda m: (m.linspace(-1.0, 1.0, 16).sort().values[:-1] + m.linspace(-1.0, 1.0, 16)[1:]) / 2,
    "full int64": lambda m: m.full((6,), -1, dtype=m.int64),
    "int / 2": lambda m: m.zeros(4, dtype=m.int32) / 2,
    "half + bf16": lambda m: m.zeros(4, dtype=m.float16) + m.zeros(4, dtype=m.bfloat16),
    "unsqueeze": lambda m: m.zeros(4, 6).unsqueeze(1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_matches_torch(st, name):
    assert _layout(CASES[name](st)) == _layout(CASES[name](torch))


def test_what_torch_refuses_is_refused(st):
    with pytest.raises(RuntimeError):
        st.eye(4).T.view(-1)
    with pytest.raises(RuntimeError):
        st.zeros(2, 3).expand(4, 3)
    with pytest.raises(RuntimeError):
        st.zeros(6).view(4, -1)
    with pytest.raises(AttributeError):  # anything not modelled fails loudly
        st.zeros(4).cumsum(0)


def test_the_worker_keys_kernels_as_with_real_torch(tree_0201, tmp_path, monkeypatch):
    """Store (fp8 and MSE paths) and decode (both variants): equal Triton hashes either way."""
    preset = parse_kernel_preset(
        {"launchers": ["turboquant_store", "turboquant_decode"], "head_dim": 64, "num_heads": 6, "num_kv_heads": 2,
         "block_sizes": [16], "max_model_len": 256, "max_num_seqs": 2,
         "kv_cache_presets": ["turboquant_k8v4", "turboquant_4bit_nc"]},
        "float16", "turboquant_k8v4", 1, lambda field, why: pytest.fail(f"{field}: {why}"))
    toolchain = toolchain_for("3.6.0", "test-image", TOOLCHAIN_CACHE)
    sources = KernelSources({}, tree_0201.root)

    def kernels(cache_name: str) -> list:
        result = compile_kernel_caches(preset, [90], sources, toolchain, tmp_path / cache_name, jobs=1)[90]
        assert not [launch["error"] for launch in result.launches if launch["error"]]
        return [launch["kernels"] for launch in result.launches]

    standin = kernels("standin")
    real_run = aot._run_worker
    monkeypatch.setattr(aot, "_run_worker", lambda toolchain, job, *rest: real_run(
        toolchain, {**job, "standin_torch": None}, *rest))  # the worker then imports real torch
    monkeypatch.setattr(aot, "_entry_key", lambda *args: "real-torch")
    real = kernels("torch")
    names = {kernel["name"] for launch in standin for kernel in launch}
    assert {"_tq_fused_store_fp8", "_tq_fused_store_mse", "_tq_decode_stage1", "_fwd_kernel_stage2"} <= names
    assert json.dumps(standin) == json.dumps(real)
