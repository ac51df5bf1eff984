"""P67: a multi-query, GQA-grouped Triton kernel for TurboQuant spec-verify batches.

P67b runs a uniform K+1 verify batch through upstream's decode kernel with one row per query
token, which launches ``N * Hq * splits`` programs and unpacks every cached key and value
once per query token and query head: ``q_len * Hq / Hk`` times for the same bytes. This patch
adds ``v1/attention/ops/triton_turboquant_spec_verify.py`` (its text is
``p67_files/triton_turboquant_spec_verify.py`` beside this module): one program per
(request, KV head, KV split) holds the ``q_len * group`` query rows sharing a KV head, unpacks
each tile of the cache once, applies each row's causal limit (``seq_len - q_len + i + 1``),
and a second kernel merges the splits by log-sum-exp. Any group size works (rows are padded
to a power of two, so 3 or 6 query heads per KV head are fine); head dims 64/128/256 and up
to 64 rows per program are taken, other shapes keep P67b's decode launch. Grids are fixed
by host-side shapes, so FULL cudagraphs capture it like P67b's path.

The kernel file is new (a ``NewFile`` edit: it applies where the pristine tree lacks it), the
backend imports it, and P67b's ``_spec_verify_attention`` tries it first. Genesis's P67 baked
``GENESIS_P67_MAX_PRIOR_LEN`` and a debug-compare switch into the source; neither exists
here (no length cap: the split grid covers any context; numerics are checked in CI instead,
``tests/patchsets/attention_turboquant/test_p67.py``, against a PyTorch decoder of the cache bytes).

Verdict on 0.33.0: APPLIES, with P67b. The new file's path is free, the backend's
``triton_turboquant_store`` import (the import anchor) is unchanged, and the cache the kernel
reads is the AoS layout the default store still writes (``kv_cache.transpose(1, 2)`` view
with its strides, which the kernel takes as given); the ROCm SoA layout never reaches it
because P67b skips SoA caches.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0): APPLIES on every one, with P67b. The kernel's path is free in all of them,
the backend's ``triton_turboquant_store`` import (the anchor) is unchanged, and nothing
upstream batches spec-verify queries per KV head.
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, NewFile, Patch
from kiln.patch.shapes import (
    assign_to,
    cls,
    func,
    insert_after,
    insert_before,
    marked,
    statements,
    with_marker,
)

TARGET = "v1/attention/backends/turboquant_attn.py"
KERNEL = "v1/attention/ops/triton_turboquant_spec_verify.py"
IMPL = cls("TurboQuantAttentionImpl")
VERIFY = func("_spec_verify_attention", leading_lines=marked("P67b"))
WHY = "multi-query GQA-grouped kernel: each cached tile unpacked once per (request, KV head)"


class AddSpecVerifyKernel(NewFile):
    target = KERNEL
    content = "p67_files/triton_turboquant_spec_verify.py"
    patched = (func("triton_turboquant_spec_verify_attention", leading_lines=marked("P67")),)


class ImportSpecVerifyKernel(Codemod):
    """Import the launcher next to the backend's store import."""

    target = TARGET
    # ``from vllm.v1.attention.ops.triton_turboquant_store import ...`` (0.33.0 also imports a
    # ``turboquant_soa.triton_turboquant_store`` inside a function: not this one)
    anchor = (
        m.SimpleStatementLine(
            body=[
                m.ImportFrom(
                    module=m.Attribute(value=m.Attribute(attr=m.Name("ops")), attr=m.Name("triton_turboquant_store"))
                )
            ]
        ),
    )
    patched = (m.SimpleStatementLine(body=[m.ImportFrom()], leading_lines=marked("P67")),)

    def rewrite(self, node):
        (imported,) = statements(
            """
            from vllm.v1.attention.ops.triton_turboquant_spec_verify import (
                spec_verify_kernel_supports,
                triton_turboquant_spec_verify_attention,
            )
            """
        )
        return insert_after(node, with_marker(imported, "P67", WHY), blank_line=False)


class TryKernelFirst(Codemod):
    """At the top of P67b's ``_spec_verify_attention``: supported shapes take the new kernel."""

    target = TARGET
    anchor = (IMPL, VERIFY, assign_to("num_tokens"))
    patched = (IMPL, VERIFY, m.If(leading_lines=marked("P67")))

    def rewrite(self, node):
        (dispatch,) = statements(
            """
            if spec_verify_kernel_supports(
                self.head_size, attn_metadata.max_query_len, self.num_heads, self.num_kv_heads
            ):
                return triton_turboquant_spec_verify_attention(
                    query,
                    kv_cache,
                    attn_metadata.block_table,
                    attn_metadata.seq_lens,
                    attn_metadata.max_query_len,
                    PiT if PiT is not None else Pi.T.contiguous(),
                    centroids,
                    self.scale,
                    mse_bits=self.tq_config.key_mse_bits,
                    key_packed_size=self.tq_config.key_packed_size,
                    value_quant_bits=self.tq_config.effective_value_quant_bits,
                    key_fp8=self.tq_config.key_fp8,
                    norm_correction=self.tq_config.norm_correction,
                    num_kv_splits=self.max_num_kv_splits,
                )
            """
        )
        return insert_before(node, with_marker(dispatch, "P67", WHY))


class P67(Patch):
    id = "P67"
    family = "attention_turboquant"
    title = "TurboQuant spec-verify kernel: multi-query, GQA-grouped (new ops file)"
    why = (
        "P67b's decode launch unpacks every cached key/value once per query token and query "
        "head. A dedicated kernel handles a request's q_len x group query rows per KV head in "
        "one program, unpacking each cache tile once; unsupported shapes keep P67b's path."
    )
    upstream_refs = ("vllm#40914",)
    requires = ("P67b",)
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",))
    perf_critical = True
    variant = True  # with P67b, instead of P65
    edits = (AddSpecVerifyKernel, ImportSpecVerifyKernel, TryKernelFirst)
