"""P65: TurboQuant under speculative decoding keeps FULL cudagraphs for plain decode only.

On 0.20.1 the TurboQuant metadata builder declares ``UNIFORM_BATCH`` cudagraph support, so
with MTP/spec decode vLLM captures FULL graphs for K+1-token verify batches too. The capture
runs ``_prefill_attention``'s Python loop with dummy metadata (a ``.tolist()`` of capture-time
sequence lengths) and bakes it into the graph; replays then attend over the wrong lengths and
tool calls cascade (vllm#40880, #53180). The fix reports ``UNIFORM_SINGLE_TOKEN_DECODE`` when
a speculative config is set: vLLM falls back to PIECEWISE for verify batches (~20-30% slower
than P67b, which keeps FULL graphs, hence the conflict) but the output is correct.

The speculative-config test stays in the emitted code: one image serves models with and
without MTP. On 0.33.0 the builder still declares ``UNIFORM_BATCH`` with no override, and the
fixes upstream (#53406/#53410) are not merged, so the patch still applies there.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0): APPLIES on every one. ``TurboQuantMetadataBuilder`` keeps
``_cudagraph_support = UNIFORM_BATCH`` without a ``get_cudagraph_support`` override and does
not treat spec verify as decode (``supports_spec_as_decode=False``,
``turboquant_attn.py:192`` on 0.20.1, ``:224`` on 0.33.0); ``_prefill_attention`` stays a
per-request host loop.
"""

from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import assign_to, cls, func, insert_after, marked, statements, with_marker

BUILDER = cls("TurboQuantMetadataBuilder")
WHY = "report single-token decode under spec decode so verify batches are not FULL-captured"


class ReportSingleTokenDecodeUnderSpec(Codemod):
    """Add ``get_cudagraph_support`` to the builder, right after its ``_cudagraph_support``."""

    target = "v1/attention/backends/turboquant_attn.py"
    anchor = (BUILDER, assign_to("_cudagraph_support"))
    patched = (BUILDER, func("get_cudagraph_support", leading_lines=marked("P65")))
    # vLLM's own fix, if it lands in this shape: the builder overrides the classmethod itself.
    upstream = (BUILDER, func("get_cudagraph_support"))

    def rewrite(self, node):
        (method,) = statements(
            """
            @classmethod
            def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
                if vllm_config.speculative_config is not None:
                    return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
                return cls._cudagraph_support
            """
        )
        return insert_after(node, with_marker(method, "P65", WHY))


class P65(Patch):
    id = "P65"
    family = "attention_turboquant"
    title = "TurboQuant spec-decode cudagraph downgrade (FULL only for single-token decode)"
    why = (
        "With spec decode, FULL cudagraph capture of TurboQuant verify batches bakes dummy "
        "prefill metadata into the graph and corrupts outputs (tool-call cascades). Report "
        "UNIFORM_SINGLE_TOKEN_DECODE when a speculative config is set."
    )
    upstream_refs = ("vllm#40880", "vllm#53180", "vllm#53406", "vllm#53410")
    conflicts = ("P67b",)
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",))
    edits = (ReportSingleTokenDecodeUnderSpec,)

