"""P38: TurboQuant continuation prefill assembles K/V in shared persistent buffers, not per-chunk copies.

Without the patch (0.20.1), every continuation chunk longer than 128 tokens goes through
``TurboQuantAttentionImpl._continuation_prefill``, which turns the dequantized prefix into the
K/V of the whole sequence with a chain of fresh copies: ``.contiguous()`` of the transposed
prefix (K for fp8 keys, and V), ``.to(query.dtype)`` of both (a copy unless the model is
fp16), then ``torch.cat`` with the chunk: up to six prefix-sized tensors (Hk x cached_len x
D), ~300 MiB at a 100k-token prefix with Hk=2, D=128 in bf16 (Genesis measured ~512 MiB in
its 262k setup), none of it seen by the memory profiler; at prefix >= ~99k on a saturated
24 GB card the ``torch.cat`` OOMs. The fp32 rotation of MSE keys also stays alive through
the attention call.

The patch writes the prefix and the chunk straight into ``(seq_len, Hk, D)`` views of one K
and one V buffer in the query dtype, shared by all TurboQuant layers (they run one after
another) through the module-level pool ``_tq_shared_kv_full``; each copy is a single
``copy_`` that also converts the dtype. ``TurboQuantAttentionImpl.__init__`` reserves the pool
at ``max_model_len`` in the model dtype during model construction (counted by
``load_model``'s memory accounting, so the KV cache is sized with it), when continuation
prefill can happen at all (``max_num_batched_tokens`` above the 128-token decode-kernel
threshold); it grows, never shrinks, if a request needs more. Numerics are unchanged: the
MSE keys still go fp32 rotation -> fp16 -> query dtype, and fp16 values are converted once, as
``.to(qdtype)`` did. The reservation costs ``2 * max_model_len * Hk * D`` elements of KV
cache capacity (256 MiB at 262k, Hk=2, D=128, bf16): predictable, instead of a transient
peak the profiler never saw. The dequant buffers themselves are P22's business; the two
patches compose but neither requires the other (P22 is UPSTREAM on 0.33.0, so a ``requires``
would report this patch GATED there instead of its real verdict).

Re-based for 0.21.0 on. vLLM took half of the fix: ``_continuation_prefill`` no longer calls
``.contiguous()``, replaces ``torch.cat`` by ``k_full = torch.empty(seq_len, Hk, D)`` plus slice
copies, and rotates MSE keys with an fp16 ``layer._tq_Pi_half``; but ``k_full``/``v_full`` are
still allocated per call and never reserved. What that leaves on kiln's presets (fp16 models,
k8v4: fp8 keys, so ``k_cached_trim`` and ``v_cached_trim`` are views and ``.to(fp16)`` copies
nothing): the two buffers are the whole transient, ``2 * seq_len * Hk * D * 2`` bytes, 512 MiB
at the 27B preset's 131072 tokens (Hk=4, D=256) and at the 35B-A3B preset's 262144 (Hk=2,
D=256). The memory profiler never sees them (its dummy run has no cached prefix; 0.24.0's
``_reserve_workspace`` reserves the dequant buffers only), so a deep continuation on a card
whose KV cache filled the ``--gpu-memory-utilization`` budget still allocates half a GiB
outside it: the OOM this patch was written for is halved, not gone. So the transform keeps
its job on the new shape: ``WriteKvFullIntoSharedBuffers`` recognises either run and, on the
0.21.0 shape, replaces only the two ``torch.empty`` by views of ``_tq_shared_kv_full``, keeping
the rest of the upstream method (fp16 rotation, and the ROCm SoA dequant branch 0.28.0 added).
The pool and its reservation at ``__init__`` are the same on every release.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: APPLIES (the ``.contiguous()``/``torch.cat`` run).
- 0.21.0 on: APPLIES (the ``torch.empty`` run: ``turboquant_attn.py:808`` on 0.21.0, ``:1051``
  on 0.33.0, unchanged in between; 0.28.0 adds the SoA branch above it). The upstream change
  that moved the dequant buffers to the workspace (see P22) rewrote the 0.20.1 run; before
  this re-base the codemod only knew that run and these releases read DRIFTED.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import (
    assign_to,
    cls,
    func,
    insert_after,
    marked,
    statements,
    top_level,
    with_marker,
)

TARGET = "v1/attention/backends/turboquant_attn.py"
IMPL = cls("TurboQuantAttentionImpl")
CONTINUATION = func("_continuation_prefill")

POOL_WHY = "K/V of the whole sequence in buffers shared by all TQ layers"
RESERVE_WHY = "reserve the shared K/V buffers now, where the memory profiler counts them"
WRITE_WHY = "write the prefix and the chunk straight into the shared K/V buffers"
SHARED_WHY = "K/V of the sequence: views of the buffers reserved at init, not per-call allocations"

MAX_SPLITS = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("max_num_kv_splits")))]
        )
    ]
)


def _torch_into(name: str, fn: str) -> m.SimpleStatementLine:
    """``name = torch.<fn>(...)``."""
    return m.SimpleStatementLine(
        body=[
            m.Assign(
                targets=[m.AssignTarget(target=m.Name(name))],
                value=m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name(fn))),
            )
        ]
    )


# The run 0.20.1 has: rotate (MSE) or `.contiguous()` (fp8) the cached keys, `.contiguous()`
# the cached values, then two `torch.cat` with the chunk.
TRIM_AND_CAT = [
    m.If(test=m.UnaryOperation(operator=m.Not(), expression=m.Attribute(attr=m.Name("key_fp8")))),
    assign_to("v_cached_trim"),
    assign_to("qdtype"),
    _torch_into("k_full", "cat"),
    _torch_into("v_full", "cat"),
]
# The run 0.21.0 on has (vLLM took the copies out): two per-call `torch.empty` for the whole
# sequence, then slice copies of the prefix and the chunk into them.
FRESH_KV_FULL = [
    assign_to("qdtype"),
    _torch_into("k_full", "empty"),
    _torch_into("v_full", "empty"),
]


def _block_with(run: list) -> m.IndentedBlock:
    return m.IndentedBlock(body=[m.ZeroOrMore(), *run, m.ZeroOrMore()])


def _find_run(body: list, run: list) -> int | None:
    for i in range(len(body) - len(run) + 1):
        if all(m.matches(body[i + k], matcher) for k, matcher in enumerate(run)):
            return i
    return None


class SharedKvFullPool(Codemod):
    """Add the module-level pool right after ``_CONTINUATION_DECODE_THRESHOLD``."""

    target = TARGET
    anchor = (assign_to("_CONTINUATION_DECODE_THRESHOLD"),)
    patched = (func("_tq_shared_kv_full", leading_lines=marked("P38")),)

    def rewrite(self, node):
        pool, helper = statements(
            '''
            _TQ_SHARED_KV_FULL: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


            def _tq_shared_kv_full(
                num_kv_heads: int,
                head_size: int,
                length: int,
                dtype: torch.dtype,
                device: torch.device | str,
            ) -> tuple[torch.Tensor, torch.Tensor]:
                """(length, num_kv_heads, head_size) views of the K and V buffers of a sequence.

                One pair per dtype serves every TurboQuant layer of the process (layers run
                one after another). Reserved at model construction; grown, never shrunk,
                when a longer sequence needs more.
                """
                device = torch.device(device)
                if device.type == "cuda" and device.index is None:
                    device = torch.device("cuda", torch.cuda.current_device())
                key = (num_kv_heads, head_size, dtype)
                bufs = _TQ_SHARED_KV_FULL.get(key)
                if bufs is None or bufs[0].shape[0] < length or bufs[0].device != device:
                    _TQ_SHARED_KV_FULL.pop(key, None)
                    bufs = None  # release the old pair before allocating a larger one
                    shape = (length, num_kv_heads, head_size)
                    bufs = (
                        torch.empty(shape, dtype=dtype, device=device),
                        torch.empty(shape, dtype=dtype, device=device),
                    )
                    _TQ_SHARED_KV_FULL[key] = bufs
                return bufs[0][:length], bufs[1][:length]
            '''
        )
        return cst.FlattenSentinel([node, top_level(pool, "P38", POOL_WHY), top_level(helper, "P38", POOL_WHY)])


class ReserveKvFullAtInit(Codemod):
    """Reserve the pool at the end of ``TurboQuantAttentionImpl.__init__`` (model construction)."""

    target = TARGET
    anchor = (IMPL, func("__init__"), MAX_SPLITS)
    patched = (IMPL, func("__init__"), m.If(leading_lines=marked("P38")))

    def rewrite(self, node):
        (reserve,) = statements(
            """
            if vllm_config.model_config is not None and (
                vllm_config.scheduler_config.max_num_batched_tokens
                > _CONTINUATION_DECODE_THRESHOLD
            ):
                _tq_shared_kv_full(
                    self.num_kv_heads,
                    head_size,
                    vllm_config.model_config.max_model_len,
                    vllm_config.model_config.dtype,
                    vllm_config.device_config.device,
                )
            """
        )
        return insert_after(node, with_marker(reserve, "P38", RESERVE_WHY))


class WriteKvFullIntoSharedBuffers(Codemod):
    """The whole-sequence K/V of a continuation chunk become views of the shared buffers.

    Two shapes, one transform. On 0.20.1 the ``.contiguous()``/``.to()``/``torch.cat`` run is
    replaced by copies straight into the shared K/V. From 0.21.0 vLLM copies into two fresh
    ``torch.empty`` buffers itself; only those two allocations are replaced, so the rest of
    its method (fp16 rotation, the ROCm SoA dequant branch) stays as upstream wrote it.
    """

    target = TARGET
    anchor = (IMPL, CONTINUATION, m.OneOf(_block_with(TRIM_AND_CAT), _block_with(FRESH_KV_FULL)))
    patched = (IMPL, CONTINUATION, m.SimpleStatementLine(leading_lines=marked("P38")))

    def rewrite(self, node):
        body = list(node.body)
        at = _find_run(body, TRIM_AND_CAT)
        if at is not None:
            first, *rest = statements(
                """
                qdtype = query.dtype
                k_full, v_full = _tq_shared_kv_full(Hk, D, seq_len, qdtype, device)
                if not self.tq_config.key_fp8:
                    # Inverse-rotate MSE keys back to original space (fp32, then fp16)
                    k_rot = k_cached[0, :, :cached_len, :].reshape(-1, D).float() @ Pi
                    k_full[:cached_len] = (
                        k_rot.to(torch.float16).reshape(Hk, cached_len, D).transpose(0, 1)
                    )
                    del k_rot  # do not hold the fp32 keys through the attention call
                else:
                    k_full[:cached_len] = k_cached[0, :, :cached_len, :].transpose(0, 1)
                v_full[:cached_len] = v_cached[0, :, :cached_len, :].transpose(0, 1)
                k_full[cached_len:] = key_chunk
                v_full[cached_len:] = val_chunk
                """
            )
            first = first.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            new = [with_marker(first, "P38", WRITE_WHY), *rest]
            return node.with_changes(body=[*body[:at], *new, *body[at + len(TRIM_AND_CAT) :]])
        at = _find_run(body, FRESH_KV_FULL)
        if at is None:
            raise ValueError("neither K/V assembly run found")  # the anchor guarantees one
        (shared,) = statements("k_full, v_full = _tq_shared_kv_full(Hk, D, seq_len, qdtype, device)")
        shared = with_marker(shared.with_changes(leading_lines=body[at + 1].leading_lines), "P38", SHARED_WHY)
        return node.with_changes(body=[*body[: at + 1], shared, *body[at + len(FRESH_KV_FULL) :]])


class P38(Patch):
    id = "P38"
    family = "attention_turboquant"
    title = "TurboQuant continuation prefill: K/V in shared persistent buffers instead of per-chunk cat copies"
    why = (
        "Each long continuation chunk copies the dequantized prefix up to three times "
        "(.contiguous, .to, torch.cat): hundreds of MiB of unprofiled transients, OOM at prefix "
        ">= ~99k. Write prefix and chunk into shared K/V buffers reserved at model construction."
    )
    upstream_refs = ("vllm#40420",)
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",))
    perf_critical = True  # losing it brings back the deep-prefix OOM
    edits = (SharedKvFullPool, ReserveKvFullAtInit, WriteKvFullIntoSharedBuffers)
