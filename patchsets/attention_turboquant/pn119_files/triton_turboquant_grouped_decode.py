# SPDX-License-Identifier: Apache-2.0
"""TurboQuant decode stage 1 with the query heads of a KV head in one program.

Added to vLLM by kiln patch PN119. Upstream's ``_tq_decode_stage1`` runs one program per
(request, query head, KV split), so with grouped-query attention every cached key and value
of a KV head is loaded and unpacked once per query head that reads it (``Hq / Hk`` times).
Here one program takes up to ``_BLOCK_H`` query heads of one KV head: each tile of
``_BLOCK_KV`` cached tokens is unpacked once and scored for all of them with ``tl.dot``.

It writes what upstream's stage 1 writes, where it writes it: for every (request, query head,
split) whose token range is not empty, ``Mid_o[..., :D]`` (the split's softmax-weighted
values) and ``Mid_o[..., D]`` (its log-sum-exp); empty splits are left untouched, as
upstream's stage 2 skips them. The splits are upstream's (``cdiv(seq_len, NUM_KV_SPLITS)``
tokens each), so upstream's stage 2 merges the result unchanged.

Precision (``tl.dot`` takes fp16 operands and accumulates in float32):
- FP8 keys: the query (fp16, or bf16 whose 8-bit mantissa fp16 holds) and the keys (every
  e4m3/e4b15 value is an fp16 value) convert exactly, so the scores are upstream's up to
  float32 summation order. A bf16 query element beyond fp16's range (65504) would overflow
  where upstream's float32 scoring would not; such a query is far outside what attention
  layers produce.
- MSE keys: the rotated query (float32) and the centroid codes are rounded to fp16 (relative
  2**-11 each); the per-token norm and the scale are applied in float32 after the dot, as
  upstream does.
- Values: ``p @ (code * scale + zero)`` is computed as ``(p * scale) @ code + p @ zero``.
  The codes are small integers (exact in fp16); only ``p * scale`` is rounded to fp16
  (relative 2**-11), the zero term stays float32.
"""

import torch
from vllm.triton_utils import tl, triton

# Query heads per program: tl.dot's smallest M. Groups above 16 take several programs.
_BLOCK_H = 16
# Cached tokens per tile: tl.dot's smallest N and K.
_BLOCK_KV = 16


def grouped_decode_supports(kv_group_size: int, head_dim: int, key_fp8: int, query_dtype: torch.dtype) -> bool:
    """Whether this kernel takes the launch (host-side ints and dtypes only: never syncs).

    A group of one gains nothing from grouping; ``tl.dot`` needs 16 or more elements per row.
    With FP8 keys the query itself is scored, and only a 16-bit one converts to fp16 exactly
    (a float32 model keeps upstream's kernel); MSE keys score the float32 rotated query.
    """
    if kv_group_size < 2 or head_dim < 16:
        return False
    return not key_fp8 or query_dtype in (torch.float16, torch.bfloat16)


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
def _tq_grouped_decode_stage1(
    Q_rot_ptr,  # [B, Hq, D]: the query (FP8 keys) or the rotated float32 query (MSE keys)
    KV_cache_ptr,  # [num_blocks, block_size, Hk, slot] uint8, any strides
    Block_table_ptr,  # [B, max_num_blocks] int32
    Seq_lens_ptr,  # [B] int32
    Centroids_ptr,  # [2 ** MSE_BITS] float32
    Mid_o_ptr,  # [B, Hq, NUM_KV_SPLITS, D + 1] float32
    stride_qb,
    stride_qh,
    stride_cache_block,
    stride_cache_pos,
    stride_cache_head,
    stride_bt_b,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    KV_GROUP_SIZE: tl.constexpr,
    HEAD_TILES: tl.constexpr,  # cdiv(KV_GROUP_SIZE, BLOCK_H): programs per KV head
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
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
    bid = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    tile = tl.program_id(1) % HEAD_TILES
    sid = tl.program_id(2)

    # Row r of this program is query head kv_head * KV_GROUP_SIZE + tile * BLOCK_H + r.
    in_group = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = in_group < KV_GROUP_SIZE
    head = kv_head * KV_GROUP_SIZE + in_group

    # Upstream's split of the sequence (stage 2 recomputes it to find the non-empty splits).
    seq_len = tl.load(Seq_lens_ptr + bid)
    split_len = tl.cdiv(seq_len, NUM_KV_SPLITS)
    split_start = split_len * sid
    split_end = tl.minimum(split_start + split_len, seq_len)
    if split_start >= split_end:
        return

    d_offs = tl.arange(0, BLOCK_D)
    d_ok = d_offs < HEAD_DIM
    # Padding rows read a zero query: finite scores, never stored.
    q = tl.load(
        Q_rot_ptr + bid * stride_qb + head[:, None] * stride_qh + d_offs[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32).to(tl.float16)

    m_prev = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_prev = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    head_off = tl.cast(kv_head, tl.int64) * stride_cache_head

    for start_n in range(split_start, split_end, BLOCK_KV):
        kv_offs = start_n + tl.arange(0, BLOCK_KV)
        kv_ok = kv_offs < split_end
        block_nums = tl.load(
            Block_table_ptr + bid * stride_bt_b + kv_offs // BLOCK_SIZE, mask=kv_ok, other=0
        ).to(tl.int64)
        slot_bases = block_nums * stride_cache_block + (kv_offs % BLOCK_SIZE).to(tl.int64) * stride_cache_pos + head_off
        tile_mask = kv_ok[:, None] & d_ok[None, :]

        # Scores of every row against the tile's keys, unpacked once: [BLOCK_H, BLOCK_KV].
        if KEY_FP8:
            raw = tl.load(KV_cache_ptr + slot_bases[:, None] + d_offs[None, :], mask=tile_mask, other=0)
            if FP8_E4B15:
                keys = raw.to(tl.float8e4b15, bitcast=True).to(tl.float32)
            else:
                keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            scores = tl.dot(q, tl.trans(keys.to(tl.float16))) * ATTN_SCALE
        else:
            codes = _unpack_codes(KV_cache_ptr, slot_bases, d_offs, tile_mask, MSE_BITS)
            centroids = tl.load(Centroids_ptr + codes, mask=tile_mask, other=0.0)
            if NORM_CORRECTION:
                centroids = centroids / tl.sqrt(tl.sum(centroids * centroids, axis=1) + 1e-16)[:, None]
            norms = _load_fp16(KV_cache_ptr, slot_bases + MSE_BYTES, kv_ok)
            scores = tl.dot(q, tl.trans(centroids.to(tl.float16))) * (norms * ATTN_SCALE)[None, :]
        scores = tl.where(kv_ok[None, :], scores, -float("inf"))

        m_new = tl.maximum(tl.max(scores, axis=1), m_prev)
        re_scale = tl.exp(m_prev - m_new)
        p = tl.exp(scores - m_new[:, None])

        # Values are code * scale + zero per token: p @ values = (p * scale) @ code + p @ zero.
        value_bases = slot_bases + KPS
        codes = _unpack_codes(KV_cache_ptr, value_bases, d_offs, tile_mask, VQB)
        v_scale = _load_fp16(KV_cache_ptr, value_bases + VAL_DATA_BYTES, kv_ok)
        v_zero = _load_fp16(KV_cache_ptr, value_bases + VAL_DATA_BYTES + 2, kv_ok)
        weighted = tl.dot((p * v_scale[None, :]).to(tl.float16), codes.to(tl.float16))
        acc = acc * re_scale[:, None] + weighted + tl.sum(p * v_zero[None, :], axis=1)[:, None]
        l_prev = l_prev * re_scale + tl.sum(p, axis=1)
        m_prev = m_new

    out = Mid_o_ptr + bid * stride_mid_b + head * stride_mid_h + sid * stride_mid_s
    safe_l = tl.where(l_prev > 0.0, l_prev, 1.0)
    tl.store(out[:, None] + d_offs[None, :], acc / safe_l[:, None], mask=row_ok[:, None] & d_ok[None, :])
    tl.store(out + HEAD_DIM, m_prev + tl.log(safe_l), mask=row_ok)


# kiln PN119: grouped-head TurboQuant decode stage 1 (each cached tile unpacked once per KV head)
def tq_grouped_decode_stage1(
    q_rot: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_table: torch.Tensor,  # [B, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    centroids: torch.Tensor,
    mid_o: torch.Tensor,  # [B, Hq, num_kv_splits, D + 1] float32, written like upstream's stage 1
    *,
    num_kv_splits: int,
    kv_group_size: int,
    mse_bits: int,
    mse_bytes: int,
    key_packed_size: int,
    value_quant_bits: int,
    value_data_bytes: int,
    scale: float,
    key_fp8: int,
    norm_correction: int,
    fp8_e4b15: int,
) -> None:
    """Launch the grouped stage 1 on upstream's arguments (a fixed grid: cudagraph-safe)."""
    batch, _, head_dim = q_rot.shape
    num_kv_heads = kv_cache.shape[2]
    head_tiles = triton.cdiv(kv_group_size, _BLOCK_H)
    _tq_grouped_decode_stage1[(batch, num_kv_heads * head_tiles, num_kv_splits)](
        q_rot,
        kv_cache,
        block_table,
        seq_lens,
        centroids,
        mid_o,
        q_rot.stride(0),
        q_rot.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[1],
        NUM_KV_SPLITS=num_kv_splits,
        KV_GROUP_SIZE=kv_group_size,
        HEAD_TILES=head_tiles,
        BLOCK_H=_BLOCK_H,
        BLOCK_KV=_BLOCK_KV,
        KEY_FP8=1 if key_fp8 else 0,
        FP8_E4B15=fp8_e4b15,
        MSE_BITS=mse_bits,
        MSE_BYTES=mse_bytes,
        NORM_CORRECTION=1 if norm_correction else 0,
        KPS=key_packed_size,
        VQB=value_quant_bits,
        VAL_DATA_BYTES=value_data_bytes,
        ATTN_SCALE=scale,
        num_warps=4,
        num_stages=2,
    )
