"""Stand-ins for running pieces of vLLM's TurboQuant backend (``turboquant_attn.py``) on CPU.

The real module imports Triton kernels and CUDA-only helpers, so the TurboQuant behaviour
tests take the patched methods and the module-level statements a patch added out of the
patched file, and execute them against these stand-ins with CPU torch:

- ``dequant_kernel``: ``_tq_full_dequant_kv[grid](...)``. The stand-in cache stores fp16 K and
  V as they are (``(num_blocks, block_size, Hk, 2 * D)``), so "dequantizing" is a gather
  through the block table; like the real kernel it writes every position up to ``alloc_len``.
- ``impl``: the ``self`` of ``TurboQuantAttentionImpl`` with the attributes the methods read.
- ``exec_init``: runs the (patched) ``TurboQuantAttentionImpl.__init__`` with stand-ins for the
  vLLM config and the imports it makes.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import libcst as cst
import torch
import torch.nn.functional as F

from tests.patchsets.support.patchlib import extract

TARGET = "v1/attention/backends/turboquant_attn.py"


def marked_top_level(source: str, patch_id: str) -> str:
    """The module-level statements of ``source`` that carry ``patch_id``'s marker."""
    module = cst.parse_module(source)
    prefix = f"# kiln {patch_id}:"
    picked = [
        stmt
        for stmt in module.body
        if any(line.comment and line.comment.value.startswith(prefix) for line in stmt.leading_lines)
    ]
    assert picked, f"no module-level statement marked {patch_id}"
    return "\n".join(module.code_for_node(stmt) for stmt in picked)


class _DequantKernel:
    """``_tq_full_dequant_kv[grid](kv_cache, block_table, centroids, k_out, v_out, ...)``."""

    def __init__(self):
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getitem__(self, grid):
        alloc_len, _ = grid

        def launch(kv_cache, block_table, centroids, k_out, v_out, *strides, HEAD_DIM, BLOCK_SIZE, **_):
            self.outputs.append((k_out, v_out))
            pos = torch.arange(alloc_len)
            slots = kv_cache[block_table[0, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE]  # (L, Hk, 2D)
            k_out[0].copy_(slots[..., :HEAD_DIM].transpose(0, 1))
            v_out[0].copy_(slots[..., HEAD_DIM:].transpose(0, 1))

        return launch


def dequant_kernel() -> _DequantKernel:
    return _DequantKernel()


def module_namespace(kernel: _DequantKernel | None = None, *, flash_attn: bool = False) -> dict:
    """The globals ``turboquant_attn.py``'s methods use, with CPU stand-ins."""
    return {
        "torch": torch,
        "F": F,
        "math": math,
        "Any": Any,
        "triton": types.SimpleNamespace(next_power_of_2=lambda n: 1 << (n - 1).bit_length()),
        "_tq_full_dequant_kv": kernel or dequant_kernel(),
        "_use_fp8_e4b15": lambda index: 0,
        "_HAS_FLASH_ATTN": flash_attn,
        "_CONTINUATION_DECODE_THRESHOLD": 128,
    }


def load(source: str, names: list[str], namespace: dict, patch_ids: tuple[str, ...] = ()) -> dict:
    """Exec the module-level additions of ``patch_ids`` and the methods ``names`` into ``namespace``."""
    for pid in patch_ids:
        exec(compile(marked_top_level(source, pid), f"patched:{pid}", "exec"), namespace)
    for name in names:
        exec(compile(extract(source, name), f"patched:{name}", "exec"), namespace)
    return namespace


def impl(*, key_fp8: bool, head_size: int, scale: float = 0.25, flash_attn_varlen=None) -> types.SimpleNamespace:
    """``self`` of TurboQuantAttentionImpl as ``_continuation_prefill`` reads it."""
    return types.SimpleNamespace(
        _mse_bytes=head_size,
        _val_data_bytes=head_size,
        scale=scale,
        tq_config=types.SimpleNamespace(
            key_packed_size=head_size,
            effective_value_quant_bits=8,
            key_mse_bits=4,
            key_fp8=key_fp8,
            norm_correction=False,
        ),
        _flash_attn_varlen=flash_attn_varlen,
    )


def sdpa_flash_attn_varlen(calls: list):
    """A ``_flash_attn_varlen`` for one request (causal, bottom-right aligned) built on SDPA."""

    def flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        calls.append({"k": k, "cu_q": cu_seqlens_q, "cu_k": cu_seqlens_k, "q_vals": cu_seqlens_q.tolist(), "k_vals": cu_seqlens_k.tolist()})
        q_len, seq_len = q.shape[0], k.shape[0]
        mask = torch.arange(seq_len).unsqueeze(0) <= torch.arange(q_len).unsqueeze(1) + (seq_len - q_len)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            enable_gqa=k.shape[1] < q.shape[1],
        )
        return out[0].transpose(0, 1)

    return flash


def continuation_inputs(*, cached_len: int, q_len: int, hq: int = 4, hk: int = 2, d: int = 16, block_size: int = 16, dtype=torch.bfloat16, seed: int = 0):
    """Random inputs of one continuation chunk (the cache holds fp16 K|V per slot)."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = cached_len + q_len
    num_blocks = math.ceil(seq_len / block_size) + 2
    kv_cache = torch.randn(num_blocks, block_size, hk, 2 * d, generator=gen).to(torch.float16)
    block_table = torch.randperm(num_blocks, generator=gen).to(torch.int32).unsqueeze(0)
    pi, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    return {
        "query": torch.randn(q_len, hq, d, generator=gen).to(dtype),
        "key_chunk": torch.randn(q_len, hk, d, generator=gen).to(dtype),
        "val_chunk": torch.randn(q_len, hk, d, generator=gen).to(dtype),
        "kv_cache": kv_cache,
        "block_table": block_table,
        "cached_len": cached_len,
        "seq_len": seq_len,
        "Pi": pi.float(),
        "centroids": torch.zeros(16),
    }


class Layer:
    """An attention layer object (the methods hang per-layer state on it)."""


def _fake_module(monkeypatch, name: str, **attrs) -> None:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        dotted = ".".join(parts[:i])
        if dotted not in sys.modules or i == len(parts):
            monkeypatch.setitem(sys.modules, dotted, types.ModuleType(dotted))
    for key, value in attrs.items():
        setattr(sys.modules[name], key, value)


def vllm_config(*, max_model_len: int = 1000, block_size: int = 16, max_num_batched_tokens: int = 2048, dtype=torch.bfloat16, model: bool = True):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=max_model_len, dtype=dtype) if model else None,
        cache_config=types.SimpleNamespace(block_size=block_size),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
        device_config=types.SimpleNamespace(device=torch.device("cpu")),
        attention_config=types.SimpleNamespace(tq_max_kv_splits_for_cuda_graph=32),
    )


def exec_init(source: str, namespace: dict, config, monkeypatch, *, num_heads: int = 4, head_size: int = 16, num_kv_heads: int = 2):
    """Construct a stand-in impl with the (patched) ``TurboQuantAttentionImpl.__init__``."""
    tq_config = types.SimpleNamespace(key_mse_bits=4, key_fp8=False, effective_value_quant_bits=4, n_centroids=16)
    _fake_module(
        monkeypatch,
        "vllm.model_executor.layers.quantization.turboquant.config",
        TurboQuantConfig=types.SimpleNamespace(from_cache_dtype=lambda dtype, head_size: tq_config),
    )
    namespace.update(
        {
            "get_current_vllm_config": lambda: config,
            "get_flash_attn_version": lambda head_size: None,
            "AttentionType": types.SimpleNamespace(DECODER="decoder"),
        }
    )
    exec(compile(extract(source, "TurboQuantAttentionImpl.__init__"), "patched:__init__", "exec"), namespace)
    obj = types.SimpleNamespace()
    namespace["__init__"](obj, num_heads, head_size, 0.25, num_kv_heads=num_kv_heads, kv_cache_dtype="turboquant_4bit_nc")
    return obj
