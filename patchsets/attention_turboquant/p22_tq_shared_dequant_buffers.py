"""P22: TurboQuant continuation-prefill dequant buffers shared by all layers and reserved up front.

Without the patch (0.20.1), ``TurboQuantAttentionImpl._continuation_prefill`` lazily allocates
a K and a V dequant buffer of ``(1, Hk, alloc_len, D)`` fp16 *per layer* (``layer.
_tq_k_dequant_buf``/``_tq_v_dequant_buf``), grown to the longest cached prefix seen. None of it
exists when vLLM sizes the KV cache: ``profile_run`` goes through ``_dummy_run`` without
attention metadata and without a KV cache, so ``TurboQuantAttentionImpl.forward`` returns before
``_ensure_on_device`` and ``do_kv_cache_update`` is never called. The first long continuation
chunk then allocates ``2 * Hk * L * D * 2`` bytes for every TQ layer on a GPU whose free memory
was handed to the KV cache: OOM at ~185-234k context. Each call also builds ``cu_seqlens`` with
two ``torch.tensor([0, n], device=...)`` host-to-device copies.

Genesis rebinds ``_ensure_on_device`` at runtime to attach shared buffers; on 0.20.1 that
rebind is skipped by its own probe (it looks for ``_init_turboquant_buffers`` on the impl,
but 0.20.1 defines it on ``Attention`` in ``model_executor/layers/attention/attention.py``),
and even applied it would run too late: ``_ensure_on_device`` is not reached during the
profile run (see above). kiln edits the source instead, at the point vLLM itself uses for the
decode buffers in ``Attention._init_turboquant_buffers``: model construction, which runs
inside ``load_model``'s memory accounting (``model_memory_usage`` is the ``weights_memory`` of
``memory_profiling``), so the KV cache is sized with the buffers already counted:

- a module-level pool ``_tq_shared_dequant_buffers`` holds one K/V pair per (Hk, D) for the
  whole process (layers run one after another; grown, never shrunk, if a request needs more);
- ``TurboQuantAttentionImpl.__init__`` reserves it at ``max_model_len`` (rounded up to the
  block size) when continuation prefill can happen (``max_num_batched_tokens`` above the
  128-token decode-kernel threshold); the per-layer lazy buffers are gone from
  ``_continuation_prefill``, which takes the shared pair;
- ``cu_seqlens`` live in one small device tensor per layer, updated in place (a device-side
  fill, no host sync).

The reservation is ``2 * max_model_len * Hk * D * 2`` bytes once per process (256 MiB at
262k, Hk=2, D=128), where the pristine code could grow that much in every TurboQuant layer.

Like the per-layer buffers it replaces, the pool is not partitioned by micro-batch, so
dual-batch overlap (two micro-batches in flight) is no safer than before.

Verdict on 0.33.0: UPSTREAM. ``TurboQuantAttentionImpl._continuation_prefill`` takes its K/V
dequant buffers from ``current_workspace_manager().get_simultaneous`` (one workspace shared by
all layers), ``TurboQuantMetadataBuilder._reserve_workspace`` reserves them at
``max_model_len`` before the workspace is locked, and ``cu_seqlens`` are persistent
``self._cu_2_q``/``self._cu_2_k`` filled in place. ``Patch.upstream_fix`` checks that shape.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: APPLIES.
- 0.21.0-0.23.0: DRIFTED, half upstream. ``_continuation_prefill`` takes its K/V dequant
  buffers from the shared ``WorkspaceManager`` (``turboquant_attn.py:747``) and fills
  persistent ``cu_seqlens`` in place (``:822``): ``DequantIntoSharedBuffers`` and
  ``DeviceSideCuSeqlens`` report "upstream shape present". But nothing reserves that
  workspace at ``max_model_len`` before ``GPUModelRunner`` locks it after cudagraph capture
  (``lock_workspace``), so the first long continuation chunk fails with "Workspace is locked"
  (vllm#41726 on a 0.20.2 nightly, #46767 on 0.23.0) where 0.20.1 ran out of memory. The
  failure is live and the anchors are gone: re-anchoring would mean reserving the workspace,
  which is what upstream did next.
- 0.24.0 on: UPSTREAM. ``TurboQuantMetadataBuilder._reserve_workspace`` reserves the
  continuation buffers at ``max_model_len`` when chunked prefill can take that path
  (``turboquant_attn.py:223`` on 0.24.0, ``:243`` on 0.33.0); the PR was not identified.
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
    place_of,
    statements,
    top_level,
    with_marker,
)

TARGET = "v1/attention/backends/turboquant_attn.py"
IMPL = cls("TurboQuantAttentionImpl")
BUILDER = cls("TurboQuantMetadataBuilder")
CONTINUATION = func("_continuation_prefill")

POOL_WHY = "continuation-prefill K/V dequant buffers shared by all TQ layers"
RESERVE_WHY = "reserve the shared dequant buffers now, where the memory profiler counts them"
USE_WHY = "the shared dequant buffers, not per-layer lazily grown ones"
CU_WHY = "device-side cu_seqlens updated in place, no per-call host-to-device copies"


def _self_attr(name: str) -> m.Attribute:
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


# `self.max_num_kv_splits = (...)`: the last statement of TurboQuantAttentionImpl.__init__ on 0.20.1.
MAX_SPLITS = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=_self_attr("max_num_kv_splits"))])])
# `buf_shape = (1, Hk, alloc_len, D)`, `k_buf = getattr(layer, "_tq_k_dequant_buf", None)`, then
# the `if` that allocates and stores per-layer buffers.
BUF_SHAPE = assign_to("buf_shape")
LAZY_LOOKUP = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name("k_buf"))], value=m.Call(func=m.Name("getattr")))]
)
LAZY_GROW = m.If(
    body=m.IndentedBlock(
        body=[
            m.ZeroOrMore(),
            m.SimpleStatementLine(
                body=[
                    m.Assign(
                        targets=[
                            m.AssignTarget(target=m.Attribute(value=m.Name("layer"), attr=m.Name("_tq_k_dequant_buf")))
                        ]
                    )
                ]
            ),
            m.ZeroOrMore(),
        ]
    )
)


def _tensor_from_list(name: str) -> m.SimpleStatementLine:
    """``name = torch.tensor([...], ...)``: a host list copied to the device on every call."""
    return m.SimpleStatementLine(
        body=[
            m.Assign(
                targets=[m.AssignTarget(target=m.Name(name))],
                value=m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("tensor"))),
            )
        ]
    )


class SharedDequantBufferPool(Codemod):
    """Add the module-level pool right after ``_CONTINUATION_DECODE_THRESHOLD``."""

    target = TARGET
    anchor = (assign_to("_CONTINUATION_DECODE_THRESHOLD"),)
    patched = (func("_tq_shared_dequant_buffers", leading_lines=marked("P22")),)

    def rewrite(self, node):
        pool, helper = statements(
            '''
            _TQ_SHARED_DEQUANT_BUFFERS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


            def _tq_shared_dequant_buffers(
                num_kv_heads: int, head_size: int, length: int, device: torch.device | str
            ) -> tuple[torch.Tensor, torch.Tensor]:
                """fp16 K/V dequant buffers of shape (1, num_kv_heads, >= length, head_size).

                One pair serves every TurboQuant layer of the process (layers run one after
                another). Reserved at model construction; grown, never shrunk, when a longer
                cached prefix needs more.
                """
                device = torch.device(device)
                if device.type == "cuda" and device.index is None:
                    device = torch.device("cuda", torch.cuda.current_device())
                key = (num_kv_heads, head_size)
                bufs = _TQ_SHARED_DEQUANT_BUFFERS.get(key)
                if bufs is None or bufs[0].shape[2] < length or bufs[0].device != device:
                    _TQ_SHARED_DEQUANT_BUFFERS.pop(key, None)
                    bufs = None  # release the old pair before allocating a larger one
                    shape = (1, num_kv_heads, length, head_size)
                    bufs = (
                        torch.empty(shape, dtype=torch.float16, device=device),
                        torch.empty(shape, dtype=torch.float16, device=device),
                    )
                    _TQ_SHARED_DEQUANT_BUFFERS[key] = bufs
                return bufs
            '''
        )
        return cst.FlattenSentinel([node, top_level(pool, "P22", POOL_WHY), top_level(helper, "P22", POOL_WHY)])


class ReserveDequantBuffersAtInit(Codemod):
    """Reserve the pool at the end of ``TurboQuantAttentionImpl.__init__`` (model construction)."""

    target = TARGET
    anchor = (IMPL, func("__init__"), MAX_SPLITS)
    patched = (IMPL, func("__init__"), m.If(leading_lines=marked("P22")))

    def rewrite(self, node):
        (reserve,) = statements(
            """
            if vllm_config.model_config is not None and (
                vllm_config.scheduler_config.max_num_batched_tokens
                > _CONTINUATION_DECODE_THRESHOLD
            ):
                block_size = vllm_config.cache_config.block_size
                _tq_shared_dequant_buffers(
                    self.num_kv_heads,
                    head_size,
                    math.ceil(vllm_config.model_config.max_model_len / block_size) * block_size,
                    vllm_config.device_config.device,
                )
            """
        )
        return insert_after(node, with_marker(reserve, "P22", RESERVE_WHY))


def _replace_run(block: cst.IndentedBlock, run: list, new: list) -> cst.IndentedBlock:
    """Replace the first run of consecutive statements matching ``run`` in ``block``."""
    body = list(block.body)
    for i in range(len(body) - len(run) + 1):
        if all(m.matches(body[i + k], matcher) for k, matcher in enumerate(run)):
            return block.with_changes(body=[*body[:i], *new, *body[i + len(run) :]])
    raise ValueError("statement run not found")  # the anchor guarantees it is there


# vLLM's shape (0.21.0 on): the dequant buffers come from the shared WorkspaceManager (reserved by
# the builder from 0.24.0), and cu_seqlens are persistent device tensors filled in place.
WORKSPACE_TAKE = m.Call(
    func=m.Attribute(value=m.Call(func=m.Name("current_workspace_manager")), attr=m.Name("get_simultaneous"))
)
PERSISTENT_CU_SEQLENS = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Subscript(value=m.Attribute(value=m.Name("self"))))],
            value=m.Name("q_len"),
        )
    ]
)


class DequantIntoSharedBuffers(Codemod):
    """Replace the per-layer lazy buffers of ``_continuation_prefill`` by the shared pair."""

    target = TARGET
    anchor = (
        IMPL,
        CONTINUATION,
        m.IndentedBlock(body=[m.ZeroOrMore(), BUF_SHAPE, LAZY_LOOKUP, LAZY_GROW, m.ZeroOrMore()]),
    )
    patched = (
        IMPL,
        CONTINUATION,
        m.SimpleStatementLine(
            leading_lines=marked("P22"), body=[m.Assign(value=m.Call(func=m.Name("_tq_shared_dequant_buffers")))]
        ),
    )

    # vLLM's own version of this edit (0.21.0 on): the buffers come from its WorkspaceManager.
    upstream = (IMPL, CONTINUATION, WORKSPACE_TAKE)

    def rewrite(self, node):
        (take,) = statements("k_buf, v_buf = _tq_shared_dequant_buffers(Hk, D, alloc_len, device)")
        return _replace_run(node, [BUF_SHAPE, LAZY_LOOKUP, LAZY_GROW], [with_marker(take, "P22", USE_WHY)])


class DeviceSideCuSeqlens(Codemod):
    """Replace the two per-call ``torch.tensor([0, n])`` cu_seqlens by an in-place updated pair."""

    target = TARGET
    anchor = (
        IMPL,
        CONTINUATION,
        m.If(
            test=m.Name("_HAS_FLASH_ATTN"),
            body=m.IndentedBlock(
                body=[_tensor_from_list("cu_seqlens_q"), _tensor_from_list("cu_seqlens_k"), m.ZeroOrMore()]
            ),
        ),
    )
    patched = (IMPL, CONTINUATION, m.If(leading_lines=marked("P22")))
    # vLLM's own version of this edit (0.21.0 on): ``self._cu_2_q[1:2] = q_len``.
    upstream = (IMPL, CONTINUATION, PERSISTENT_CU_SEQLENS)

    def rewrite(self, node):
        ensure, *fill = statements(
            """
            if getattr(self, "_tq_cu_seqlens", None) is None:
                self._tq_cu_seqlens = torch.zeros(2, 2, device=device, dtype=torch.int32)
            cu_seqlens_q, cu_seqlens_k = self._tq_cu_seqlens
            cu_seqlens_q[1:2] = q_len  # a fill on the device: no host sync
            cu_seqlens_k[1:2] = seq_len
            """
        )
        body = list(node.body.body)
        return node.with_changes(body=node.body.with_changes(body=[with_marker(ensure, "P22", CU_WHY), *fill, *body[2:]]))


class P22(Patch):
    id = "P22"
    family = "attention_turboquant"
    title = "TurboQuant continuation-prefill dequant buffers shared across layers and reserved before KV sizing"
    why = (
        "Continuation prefill lazily allocates K/V dequant buffers per layer, after the memory "
        "profiler sized the KV cache, so long contexts OOM (~185-234k tokens). Share one pair "
        "across layers, reserve it at model construction, and keep cu_seqlens on the device."
    )
    upstream_refs = ("vllm#40420", "vllm#40655", "vllm#40706", "vllm#40798")
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",))
    perf_critical = True  # losing it brings back the long-context OOM and N-layer buffer growth
    edits = (SharedDequantBufferPool, ReserveDequantBuffersAtInit, DequantIntoSharedBuffers, DeviceSideCuSeqlens)

    def upstream_fix(self, module_of):
        # Both halves: 0.21.0-0.23.0 have the shared take without the reservation, which
        # turns the OOM into a locked-workspace AssertionError (see the module docstring).
        module = module_of(TARGET)
        reserved = place_of(TARGET, module, (BUILDER, func("_reserve_workspace"), WORKSPACE_TAKE))
        taken = place_of(TARGET, module, (IMPL, CONTINUATION, WORKSPACE_TAKE))
        if reserved and taken:
            return (
                f"{taken}: TurboQuantAttentionImpl._continuation_prefill takes its K/V dequant buffers "
                f"from the shared WorkspaceManager; {reserved}: TurboQuantMetadataBuilder."
                "_reserve_workspace reserves them at max_model_len before the workspace is locked"
            )
        return None
