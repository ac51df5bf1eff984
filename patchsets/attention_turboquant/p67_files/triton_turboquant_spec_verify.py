# SPDX-License-Identifier: Apache-2.0
"""TurboQuant attention for uniform spec-verify batches: one program per (request, KV head).

Added to vLLM by kiln patch P67. A verify batch holds ``num_reqs`` requests of ``q_len``
tokens each (the last accepted token plus the draft tokens), all of them already stored in
the TurboQuant cache. Upstream's decode kernel (what P67b launches) runs one program per query
token and query head, so every cached key and value is unpacked ``q_len * Hq / Hk`` times.
Here one program loads the ``q_len * group`` query rows that share a KV head, unpacks each
key/value tile once, and applies the causal limit per row: query ``i`` of a request sees the
first ``seq_len - q_len + i + 1`` tokens. The KV range is split across ``num_kv_splits``
programs (fixed grid, so FULL cudagraphs capture it) and a second kernel merges the splits by
their log-sum-exp.

Cache layout read (per token and KV head, bytes): keys as FP8 (``key_fp8``) or as packed
``mse_bits`` centroid indices followed by an fp16 norm (keys live in the rotated space, so
the query is rotated by ``PiT`` first); at ``key_packed_size`` the values, packed
``value_quant_bits``-bit codes followed by an fp16 scale and an fp16 zero.
"""

import torch
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15

# Query rows one program holds (q_len * group), padded to a power of two; wider groups fall
# back to the per-query decode kernel (register pressure of the [rows, head_dim] accumulator).
_MAX_ROWS = 64
_HEAD_DIMS = (64, 128, 256)
_BLOCK_KV = 16


def spec_verify_kernel_supports(head_dim: int, q_len: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether this kernel handles the shape; all host-side ints, so the answer never syncs."""
    if head_dim not in _HEAD_DIMS or num_kv_heads <= 0 or num_heads % num_kv_heads:
        return False
    return q_len * (num_heads // num_kv_heads) <= _MAX_ROWS


@triton.jit
def _unpack_codes(Cache_ptr, bases, d_offs, mask, BITS: tl.constexpr):
    """``BITS``-bit little-endian codes of element ``d`` of each row (two bytes cover any code)."""
    bit = d_offs * BITS
    addrs = bases[:, None] + (bit // 8)[None, :]
    lo = tl.load(Cache_ptr + addrs, mask=mask, other=0).to(tl.int32)
    hi = tl.load(Cache_ptr + addrs + 1, mask=mask, other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit % 8)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _load_fp16(Cache_ptr, addrs, mask):
    """fp16 values stored as two little-endian bytes at ``addrs``, as float32."""
    lo = tl.load(Cache_ptr + addrs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(Cache_ptr + addrs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tq_spec_verify_split(
    Q_ptr,  # [N, Hq, D]: rotated float32 queries (MSE keys) or raw queries (FP8 keys)
    Cache_ptr,  # [num_blocks, block_size, Hk, slot] uint8, any strides
    Block_table_ptr,  # [num_reqs, max_blocks] int32
    Seq_lens_ptr,  # [num_reqs] int32, context length including the request's q_len tokens
    Centroids_ptr,  # [2 ** MSE_BITS] float32
    Part_o_ptr,  # [N, Hq, NUM_KV_SPLITS, D] float32: per-split normalised output
    Part_lse_ptr,  # [N, Hq, NUM_KV_SPLITS] float32: per-split log-sum-exp (-inf: no key seen)
    stride_q_tok,
    stride_q_head,
    stride_cache_block,
    stride_cache_pos,
    stride_cache_head,
    stride_bt_req,
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_pl_tok,
    stride_pl_head,
    Q_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    KEY_FP8: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    MSE_BITS: tl.constexpr,
    MSE_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    KPS: tl.constexpr,
    VQB: tl.constexpr,
    VAL_DATA_BYTES: tl.constexpr,
    ATTN_SCALE: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Row r of this program is query position r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < Q_LEN * GROUP
    q_pos = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    token = req * Q_LEN + q_pos

    seq_len = tl.load(Seq_lens_ptr + req)
    visible_len = seq_len - Q_LEN + q_pos + 1  # causal limit of each row

    # This split's share of the request's keys, whole tiles only.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_KV) * BLOCK_KV
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    d_offs = tl.arange(0, BLOCK_D)
    d_ok = d_offs < HEAD_DIM
    q = tl.load(
        Q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + d_offs[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    # Finite floor instead of -inf keeps exp(m_old - m_new) defined for rows with nothing visible.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    head_off = tl.cast(kv_head, tl.int64) * stride_cache_head

    for tile in range(start, end, BLOCK_KV):
        pos = tile + tl.arange(0, BLOCK_KV)
        pos_ok = pos < end
        block = tl.load(Block_table_ptr + req * stride_bt_req + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        bases = (
            block.to(tl.int64) * stride_cache_block
            + (pos % BLOCK_SIZE).to(tl.int64) * stride_cache_pos
            + head_off
        )
        tile_mask = pos_ok[:, None] & d_ok[None, :]

        # Keys of the tile, unpacked once for every row: [BLOCK_KV, BLOCK_D] float32.
        if KEY_FP8:
            raw = tl.load(Cache_ptr + bases[:, None] + d_offs[None, :], mask=tile_mask, other=0)
            if FP8_E4B15:
                keys = raw.to(tl.float8e4b15, bitcast=True).to(tl.float32)
            else:
                keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            codes = _unpack_codes(Cache_ptr, bases, d_offs, tile_mask, MSE_BITS)
            keys = tl.load(Centroids_ptr + codes, mask=tile_mask, other=0.0)
            if NORM_CORRECTION:
                keys = keys / tl.sqrt(tl.sum(keys * keys, axis=1) + 1e-16)[:, None]
            keys = keys * _load_fp16(Cache_ptr, bases + MSE_BYTES, pos_ok)[:, None]

        scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * ATTN_SCALE
        visible = pos_ok[None, :] & (pos[None, :] < visible_len[:, None])
        scores = tl.where(visible, scores, -float("inf"))

        # Values of the tile: codes * scale + zero.
        value_bases = bases + KPS
        codes = _unpack_codes(Cache_ptr, value_bases, d_offs, tile_mask, VQB)
        v_scale = _load_fp16(Cache_ptr, value_bases + VAL_DATA_BYTES, pos_ok)
        v_zero = _load_fp16(Cache_ptr, value_bases + VAL_DATA_BYTES + 2, pos_ok)
        values = codes.to(tl.float32) * v_scale[:, None] + v_zero[:, None]
        values = tl.where(tile_mask, values, 0.0)

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    out_offs = token[:, None] * stride_po_tok + head[:, None] * stride_po_head + split * stride_po_split
    tl.store(Part_o_ptr + out_offs + d_offs[None, :], acc / safe_l[:, None], mask=row_ok[:, None] & d_ok[None, :])
    lse = tl.where(seen, m_i + tl.log(safe_l), -float("inf"))
    tl.store(Part_lse_ptr + token * stride_pl_tok + head * stride_pl_head + split, lse, mask=row_ok)


@triton.jit
def _tq_spec_verify_merge(
    Part_o_ptr,
    Part_lse_ptr,
    Out_ptr,  # [N, Hq, D] in the query's dtype
    stride_po_tok,
    stride_po_head,
    stride_po_split,
    stride_pl_tok,
    stride_pl_head,
    stride_out_tok,
    stride_out_head,
    NUM_KV_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d_offs = tl.arange(0, BLOCK_D)
    d_ok = d_offs < HEAD_DIM
    m = -1.0e30
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(NUM_KV_SPLITS):
        lse = tl.load(Part_lse_ptr + token * stride_pl_tok + head * stride_pl_head + split)
        part = tl.load(
            Part_o_ptr + token * stride_po_tok + head * stride_po_head + split * stride_po_split + d_offs,
            mask=d_ok,
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        weight = tl.exp(lse - m_new)  # 0 for a split that saw no key (lse = -inf)
        acc = acc * alpha + weight * part
        total = total * alpha + weight
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out_ptr + token * stride_out_tok + head * stride_out_head + d_offs,
        out.to(Out_ptr.dtype.element_ty),
        mask=d_ok,
    )


# kiln P67: multi-query GQA-grouped TurboQuant attention for uniform spec-verify batches
def triton_turboquant_spec_verify_attention(
    query: torch.Tensor,  # [num_reqs * q_len, Hq, D], request-major
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_reqs] int32
    q_len: int,
    PiT: torch.Tensor,  # [D, D] float32 (rotation applied to queries for MSE keys)
    centroids: torch.Tensor,
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool,
    norm_correction: bool,
    num_kv_splits: int,
) -> torch.Tensor:
    """Causal attention of a uniform verify batch over the TurboQuant cache: [N, Hq, D].

    Every size is a host-side int and every launch has a fixed grid, so FULL cudagraph
    capture records it and replays it with the live ``seq_lens`` and ``block_table``.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    num_reqs = num_tokens // q_len
    if key_fp8:
        q = query
    else:
        q = query.float() @ PiT
    block_d = triton.next_power_of_2(head_dim)
    part_o = torch.empty(
        num_tokens, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=query.device)
    _tq_spec_verify_split[(num_reqs, num_kv_heads, num_kv_splits)](
        q,
        kv_cache,
        block_table,
        seq_lens,
        centroids,
        part_o,
        part_lse,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        Q_LEN=q_len,
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(q_len * group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_KV=_BLOCK_KV,
        NUM_KV_SPLITS=num_kv_splits,
        KEY_FP8=1 if key_fp8 else 0,
        FP8_E4B15=_use_fp8_e4b15(query.device.index or 0),
        MSE_BITS=mse_bits,
        MSE_BYTES=(head_dim * mse_bits + 7) // 8,
        NORM_CORRECTION=1 if norm_correction else 0,
        KPS=key_packed_size,
        VQB=value_quant_bits,
        VAL_DATA_BYTES=(head_dim * value_quant_bits + 7) // 8,
        ATTN_SCALE=scale,
        num_warps=8 if head_dim > 128 else 4,
        num_stages=1,
    )
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    _tq_spec_verify_merge[(num_tokens, num_heads)](
        part_o,
        part_lse,
        out,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_KV_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out
