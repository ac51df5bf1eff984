"""Run TurboQuant's metadata builder and prefill routing (``turboquant_attn.py``) on CPU.

The behaviour tests of PN401/K4 take, from a pristine or patched backend file, the
``TurboQuantMetadata`` dataclass, ``TurboQuantMetadataBuilder.build`` (with the helpers a
patch adds to the builder), ``TurboQuantAttentionImpl.forward`` and ``_prefill_attention``,
plus the real ``split_decodes_and_prefills`` from ``v1/attention/backends/utils.py`` of the
same tree, and execute them with CPU torch. What runs on a GPU is replaced by stand-ins that
compute the same mathematics exactly:

- the KV cache holds plain fp16 K|V per slot, ``(num_blocks, block_size, Hk, 2 * D)``; the
  real backend stores it quantised, which changes values, not routing;
- ``triton_turboquant_decode_attention``: per query row, attention over the first
  ``seq_lens[row]`` positions of its block-table row (what the real kernel computes);
- ``_flash_attn_varlen``: causal, bottom-right aligned attention per request between the
  given ``cu_seqlens_q`` and ``cu_seqlens_k`` ranges of the tensors it is handed; every call is
  recorded, so a test sees which path ran;
- ``_decode_attention`` (pure decode rows of a mixed batch): the decode stand-in over the
  device ``seq_lens``.

``reference`` is attention computed independently from the cache contents and the true
lengths: query ``j`` of a request with ``q_len`` new tokens and ``seq_len`` tokens in all sees
its first ``seq_len - q_len + j + 1`` tokens.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import torch
import torch.nn.functional as F

from tests.patchsets.support.patchlib import extract

TARGET = "v1/attention/backends/turboquant_attn.py"
UTILS = "v1/attention/backends/utils.py"
HQ, HK, D, BLOCK = 4, 2, 16, 16


def _attend(q, k, v, visible):
    """q (Lq, Hq, D) over k/v (Lk, Hk, D); ``visible[j]`` keys for query j (GQA by repeat)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * D**-0.5
    mask = torch.arange(k.shape[0])[None, :] < torch.as_tensor(visible)[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Cache:
    """A stand-in KV cache: request ``r``'s positions live in its own shuffled blocks."""

    def __init__(self, lengths: list[int], seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        per_req = max(1, max(math.ceil(n / BLOCK) for n in lengths) + 1)  # one spare block each
        num_blocks = 1 + per_req * len(lengths)
        order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 stays unused
        self.block_table = order.view(len(lengths), per_req).to(torch.int32)
        # every slot holds values, including positions past a request's length (stale data
        # that a wrong length would read)
        self.data = torch.randn(num_blocks, BLOCK, HK, 2 * D, generator=gen).half()

    def kv(self, r: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(length)
        slots = self.data[self.block_table[r, pos // BLOCK].long(), pos % BLOCK]  # (L, Hk, 2D)
        return slots[..., :D], slots[..., D:]


def decode_kernel(calls: list | None = None):
    """``triton_turboquant_decode_attention`` stand-in over a stand-in cache."""

    def run(*, query, kv_cache, block_table, seq_lens, **_):
        if calls is not None:
            calls.append(seq_lens.clone())
        out = torch.empty(query.shape, dtype=query.dtype)
        for row in range(query.shape[0]):
            length = int(seq_lens[row])
            pos = torch.arange(length)
            slots = kv_cache[block_table[row, pos // BLOCK].long(), pos % BLOCK]
            out[row] = _attend(query[row : row + 1], slots[..., :D], slots[..., D:], [length])[0].to(query.dtype)
        return out

    return run


def flash_varlen(calls: list):
    """``TurboQuantAttentionImpl._flash_attn_varlen`` stand-in; records (cu_q, cu_k) per call."""

    def run(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        calls.append((cu_q, cu_k))
        out = torch.zeros(q.shape, dtype=q.dtype)
        for r in range(len(cu_q) - 1):
            qs, qe, ks, ke = cu_q[r], cu_q[r + 1], cu_k[r], cu_k[r + 1]
            if qe == qs:
                continue
            visible = [ke - ks - (qe - qs) + j + 1 for j in range(qe - qs)]
            out[qs:qe] = _attend(q[qs:qe], k[ks:ke], v[ks:ke], visible).to(q.dtype)
        return out

    return run


@dataclasses.dataclass
class Row:
    """One request of a batch: ``q_len`` new tokens, ``seq_len`` in all (cached = difference).

    ``host_extra``: how much the host's ``seq_lens_cpu_upper_bound`` over-states ``seq_len``
    (an async spec-decode verify row after a rejection).
    """

    q_len: int
    seq_len: int
    host_extra: int = 0


class Batch:
    """A batch of rows, its cache, the inputs ``forward`` gets, and the reference output."""

    def __init__(self, rows: list[Row], seed: int = 0):
        self.rows = rows
        self.cache = Cache([r.seq_len + 8 for r in rows], seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.num_tokens = sum(r.q_len for r in rows)
        self.query = torch.randn(self.num_tokens, HQ, D, generator=gen).half()
        keys, values = [], []
        for i, row in enumerate(rows):  # the new tokens' K/V, as stored by do_kv_cache_update
            k, v = self.cache.kv(i, row.seq_len)
            keys.append(k[row.seq_len - row.q_len :])
            values.append(v[row.seq_len - row.q_len :])
        self.key, self.value = torch.cat(keys), torch.cat(values)
        starts = [0]
        for row in rows:
            starts.append(starts[-1] + row.q_len)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)

    def common_metadata(self):
        """The ``CommonAttentionMetadata`` fields the TurboQuant builder reads."""
        seq_lens = torch.tensor([r.seq_len for r in self.rows], dtype=torch.int32)
        host = torch.tensor([r.seq_len + r.host_extra for r in self.rows], dtype=torch.int32)
        return types.SimpleNamespace(
            query_start_loc=self.query_start_loc.clone(),
            query_start_loc_cpu=self.query_start_loc.clone(),
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=host,
            num_reqs=len(self.rows),
            num_actual_tokens=self.num_tokens,
            max_query_len=max(r.q_len for r in self.rows),
            max_seq_len=int(host.max()),
            block_table_tensor=self.cache.block_table,
            slot_mapping=torch.zeros(self.num_tokens, dtype=torch.int64),
            causal=True,
            is_prefilling=None,
        )

    def reference(self) -> torch.Tensor:
        out = torch.empty(self.num_tokens, HQ, D)
        start = 0
        for i, row in enumerate(self.rows):
            k, v = self.cache.kv(i, row.seq_len)
            visible = [row.seq_len - row.q_len + j + 1 for j in range(row.q_len)]
            out[start : start + row.q_len] = _attend(self.query[start : start + row.q_len], k, v, visible)
            start += row.q_len
        return out


class AttentionMetadata:
    """Stand-in base class of ``TurboQuantMetadata``."""


class Backend:
    """The metadata class, builder and impl of one backend file, executed with stand-ins."""

    def __init__(self, backend_text: str, utils_text: str, builder_methods=("build",)):
        self.text = backend_text
        self.flash_calls: list = []
        self.decode_calls: list = []
        self.namespace: dict[str, Any] = {
            "torch": torch,
            "F": F,
            "math": math,
            "Any": Any,
            "dataclass": dataclasses.dataclass,
            "AttentionMetadata": AttentionMetadata,
            "AttentionLayer": object,
            "_HAS_FLASH_ATTN": True,
            "_CONTINUATION_DECODE_THRESHOLD": 128,
            "triton_turboquant_decode_attention": decode_kernel(self.decode_calls),
        }
        exec(compile(extract(utils_text, "split_decodes_and_prefills"), UTILS, "exec"), self.namespace)
        exec(compile(extract(backend_text, "TurboQuantMetadata"), TARGET, "exec"), self.namespace)
        body = {"reorder_batch_threshold": 1}
        for name in builder_methods:
            exec(compile(extract(backend_text, f"TurboQuantMetadataBuilder.{name}"), TARGET, "exec"), self.namespace)
            body[name] = self.namespace[name]
        self.builder = type("TurboQuantMetadataBuilder", (), body)()
        impl_body = {"_flash_attn_varlen": flash_varlen(self.flash_calls)}
        for name in ("forward", "_prefill_attention"):
            exec(compile(extract(backend_text, f"TurboQuantAttentionImpl.{name}"), TARGET, "exec"), self.namespace)
            impl_body[name] = self.namespace[name]
        impl_body["_ensure_on_device"] = lambda impl, layer, device: None
        impl_body["_continuation_prefill"] = _refuse("_continuation_prefill")
        kernel = self.namespace["triton_turboquant_decode_attention"]

        def decode_attention(impl, query, kv_cache, attn_metadata, *args, **kwargs):
            rows = attn_metadata.seq_lens.shape[0]
            return kernel(query=query, kv_cache=kv_cache, block_table=attn_metadata.block_table[:rows],
                          seq_lens=attn_metadata.seq_lens)

        impl_body["_decode_attention"] = decode_attention
        self.impl = type("TurboQuantAttentionImpl", (), impl_body)()
        self.impl.__dict__.update(
            num_heads=HQ, num_kv_heads=HK, head_size=D, scale=D**-0.5, num_kv_groups=HQ // HK,
            max_num_kv_splits=4, _soa_store=False, _use_flydsl=False, fa_version=None,
            tq_config=types.SimpleNamespace(key_mse_bits=0, key_packed_size=D, effective_value_quant_bits=8,
                                            key_fp8=True, norm_correction=False, value_packed_size=D),
        )

    def metadata(self, batch: Batch):
        return self.builder.build(0, batch.common_metadata())

    def forward(self, batch: Batch) -> torch.Tensor:
        """``forward`` on the batch; the cache is handed over in the layout the release expects."""
        metadata = self.metadata(batch)
        n = batch.num_tokens
        # 0.21+ allocates the cache (blocks, Hk, block_size, slot) and transposes it in forward
        transposed = "kv_cache = kv_cache.transpose(1, 2)" in extract(self.text, "TurboQuantAttentionImpl.forward")
        kv_cache = batch.cache.data.transpose(1, 2) if transposed else batch.cache.data
        layer = types.SimpleNamespace(_tq_Pi=None, _tq_PiT=None, _tq_centroids=None)
        out = self.impl.forward(layer, batch.query.reshape(n, HQ * D), batch.key.reshape(n, HK * D),
                                batch.value.reshape(n, HK * D), kv_cache, metadata)
        return out.view(n, HQ, D).float()


def _refuse(name: str):
    def run(*args, **kwargs):
        raise AssertionError(f"{name} is not expected for chunks of <= 128 tokens")

    return run
