"""P67b: TurboQuant runs uniform spec-verify batches as one decode launch, so FULL cudagraphs stay on.

TurboQuant's builder sets ``reorder_batch_threshold = 1`` without spec-as-decode, so a K+1
verify batch (every request: last token + K drafts) reaches ``forward`` as a *prefill* batch
and goes to ``_prefill_attention``, a Python loop over requests driven by host copies of
``query_start_loc``/``seq_lens`` (``.tolist()`` on 0.20.1). Under FULL cudagraph capture that
loop runs once with the capture's dummy lengths and bakes them into the graph: replays attend
over the wrong lengths (vllm#40880, #53180). P65 avoids it by giving up FULL graphs for spec
decode (~20-30% slower); this patch keeps them.

A batch is a uniform verify batch when host-side metadata says so (no device read, hence the
same at capture and replay): no decodes, ``1 < max_query_len <= 16``, ``num_reqs *
max_query_len == N`` (so every request has exactly ``max_query_len`` tokens, FULL-graph
padding requests having 0), and ``max_seq_len > max_query_len`` (a batch of fresh prompts
keeps flash attention). Such a batch goes to upstream's ``triton_turboquant_decode_attention``
with one row per query token: query ``i`` of a request attends to its first ``seq_len -
q_len + i + 1`` tokens (its own K/V included: ``do_kv_cache_update`` stored the batch before
``forward``), with the request's block-table row repeated ``q_len`` times. The lengths and
the table are built on the device from host-known shapes, so the graph replays them with the
live ``seq_lens``/``block_table``. Numerically it is the path pristine vLLM already takes per
request for short continuations (the decode kernel over the quantised cache), batched.

No environment knob: the KV split count is vLLM's own ``tq_max_kv_splits_for_cuda_graph``.
Genesis's ``GENESIS_P67_USE_UPSTREAM`` chose between this path and its own kernel; here that
choice is P67 (which requires this patch and falls back to it for shapes it does not take).

Verdict on 0.33.0: APPLIES. ``TurboQuantAttentionImpl.forward`` keeps the same
``if not attn_metadata.is_prefill / elif num_decodes == 0 / else`` chain (after transposing
``kv_cache`` to the ``(blocks, block_size, Hk, slot)`` view the kernels read, which the new
branch receives as the other paths do), ``_prefill_attention`` is still a per-request Python
loop (now over ``query_start_loc_cpu``, no sync but still frozen into a FULL graph), and
``triton_turboquant_decode_attention`` keeps the same parameters. The builder still sets
``supports_spec_as_decode=False`` (the shape ``upstream_fix`` looks for). New on 0.33.0: the
ROCm FlyDSL path stores the cache in an SoA layout (``self._soa_store``) that only its own
decoder reads; the route is skipped there.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0): APPLIES on every one. ``forward`` keeps its
decode/prefill-only/mixed chain, ``_prefill_attention`` stays a per-request host loop (over
``query_start_loc_cpu`` from 0.21.0) and the builder keeps ``supports_spec_as_decode=False``.
0.28.0 adds the ROCm SoA layout (``self._soa_store``), which the route skips.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import cls, func, insert_after, marked, place_of, statements, with_marker

TARGET = "v1/attention/backends/turboquant_attn.py"
IMPL = cls("TurboQuantAttentionImpl")
BUILDER = cls("TurboQuantMetadataBuilder")
WHY = "uniform spec-verify batch: one decode launch, no host sync (FULL cudagraphs stay on)"

# vLLM's own fix would route verify batches to the decode path the way other backends do.
SPEC_AS_DECODE = (
    BUILDER,
    func("__init__"),
    m.SimpleStatementLine(
        body=[
            m.Expr(
                value=m.Call(
                    func=m.Attribute(attr=m.Name("_init_reorder_batch_threshold")),
                    args=[
                        m.ZeroOrMore(),
                        m.Arg(keyword=m.Name("supports_spec_as_decode"), value=m.Name("True")),
                        m.ZeroOrMore(),
                    ],
                )
            )
        ]
    ),
)


class AddSpecVerifyMethods(Codemod):
    """Add the batch test and the batched decode launch to the impl, after ``_decode_attention``."""

    target = TARGET
    anchor = (IMPL, func("_decode_attention"))
    patched = (IMPL, func("_spec_verify_attention", leading_lines=marked("P67b")))

    def rewrite(self, node):
        (is_verify,) = statements(
            """
            def _is_uniform_spec_verify(self, attn_metadata: TurboQuantMetadata, num_tokens: int) -> bool:
                \"\"\"Every request verifies the same 1 < q_len <= 16 tokens over cached context.\"\"\"
                # Host-side metadata only: capture and replay of a FULL cudagraph take the same
                # branch and nothing waits on the device. Each request has at most max_query_len
                # tokens, so num_reqs * max_query_len == num_tokens means all have exactly that.
                q_len = attn_metadata.max_query_len
                num_reqs = attn_metadata.query_start_loc.shape[0] - 1
                return (
                    attn_metadata.num_decodes == 0
                    and 1 < q_len <= 16
                    and num_reqs * q_len == num_tokens
                    and attn_metadata.max_seq_len > q_len
                    # the ROCm FlyDSL SoA cache layout is read only by its own decoder
                    and not getattr(self, "_soa_store", False)
                )
            """
        )
        (attention,) = statements(
            """
            def _spec_verify_attention(
                self,
                query: torch.Tensor,  # (N, Hq, D), N = num_reqs * q_len
                kv_cache: torch.Tensor,  # (num_blocks, block_size, Hk, slot_size)
                attn_metadata: TurboQuantMetadata,
                Pi: torch.Tensor,
                centroids: torch.Tensor,
                PiT: torch.Tensor | None,
            ) -> torch.Tensor:
                \"\"\"A uniform verify batch as one decode launch with a row per query token.\"\"\"
                # Query i of a request attends to its first seq_len - q_len + i + 1 tokens (its
                # own K/V was stored before forward). Lengths and block-table rows are built on
                # the device, so a FULL cudagraph replays them with the live metadata.
                num_tokens = query.shape[0]
                q_len = attn_metadata.max_query_len
                num_reqs = num_tokens // q_len
                seq_lens = attn_metadata.seq_lens[:num_reqs]
                causal = torch.arange(1 - q_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
                # padding requests (seq_len 0) get length 0, like padded rows of a decode batch
                synth_seq_lens = (seq_lens[:, None] + causal).clamp_(min=0).reshape(num_tokens)
                block_table = attn_metadata.block_table[:num_reqs]
                synth_block_table = block_table[:, None, :].expand(-1, q_len, -1).reshape(num_tokens, -1)
                return triton_turboquant_decode_attention(
                    query=query,
                    kv_cache=kv_cache,
                    block_table=synth_block_table,
                    seq_lens=synth_seq_lens,
                    Pi=Pi,
                    centroids=centroids,
                    scale=self.scale,
                    mse_bits=self.tq_config.key_mse_bits,
                    key_packed_size=self.tq_config.key_packed_size,
                    value_quant_bits=self.tq_config.effective_value_quant_bits,
                    key_fp8=self.tq_config.key_fp8,
                    norm_correction=self.tq_config.norm_correction,
                    PiT=PiT,
                    max_num_kv_splits=self.max_num_kv_splits,
                )
            """
        )
        return insert_after(node, with_marker(is_verify, "P67b", WHY), with_marker(attention, "P67b", WHY))


class RouteSpecVerifyBatches(Codemod):
    """In ``forward``, an ``elif`` before the prefill branch sends verify batches to the launch."""

    target = TARGET
    anchor = (
        IMPL,
        func("forward"),
        m.If(test=m.UnaryOperation(operator=m.Not(), expression=m.Attribute(attr=m.Name("is_prefill")))),
    )
    patched = (IMPL, func("forward"), m.If(leading_lines=marked("P67b")))

    def rewrite(self, node: cst.If):
        (template,) = statements(
            """
            if _:
                pass
            elif self._is_uniform_spec_verify(attn_metadata, N):
                attn_out = self._spec_verify_attention(q, kv_cache, attn_metadata, Pi, centroids, PiT)
            """
        )
        route = with_marker(template.orelse, "P67b", WHY).with_changes(orelse=node.orelse)
        return node.with_changes(orelse=route)


class P67b(Patch):
    id = "P67b"
    family = "attention_turboquant"
    title = "TurboQuant uniform spec-verify batches as one decode launch (FULL cudagraphs kept)"
    why = (
        "K+1 spec-verify batches take TurboQuant's per-request prefill loop, whose host-side "
        "lengths FULL cudagraph capture freezes. Route uniform verify batches to the decode "
        "kernel with per-query causal lengths built on the device, so FULL graphs stay correct."
    )
    upstream_refs = ("vllm#40880", "vllm#40914", "vllm#53180")
    conflicts = ("P65",)
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",))
    perf_critical = True
    variant = True  # an image picks P65 or P67b
    edits = (AddSpecVerifyMethods, RouteSpecVerifyBatches)

    def upstream_fix(self, module_of):
        where = place_of(TARGET, module_of(TARGET), SPEC_AS_DECODE)
        if where:
            return f"{where}: TurboQuantMetadataBuilder treats spec verify as decode (supports_spec_as_decode=True)"
        return None
