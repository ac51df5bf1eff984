"""PN119: TurboQuant decode stage 1 with one program per KV head's query heads (GQA grouping).

Upstream's ``triton_turboquant_decode_attention`` launches ``_tq_decode_stage1`` on the grid
``(B, Hq, splits)``: one program per query head, so with grouped-query attention each cached
key and value of a KV head is loaded and unpacked (FP8 or MSE keys, 3/4-bit values) once per
query head that reads it, ``Hq / Hk`` times (6 on Qwen3.6-27B, 8 on Qwen3.6-35B-A3B), and
scored with element-wise products. This patch adds
``v1/attention/ops/triton_turboquant_grouped_decode.py`` (its text is
``pn119_files/triton_turboquant_grouped_decode.py`` beside this module): one program per
(request, KV head, split) holds up to 16 query heads of that KV head, unpacks each tile of 16
cached tokens once, and scores and accumulates with ``tl.dot`` (16-bit operands, float32
accumulation; the file's docstring gives the rounding of each operand). It writes upstream's
``mid_o`` layout and splits, so upstream's stage 2 is unchanged.

The launch becomes ``if grouped_decode_supports(...): tq_grouped_decode_stage1(...) else:
<upstream's launch, unchanged>``. The grouped launch takes the very expressions upstream's
launch passes (the six tensors, ``KV_GROUP_SIZE``, ``HEAD_DIM``, ``MSE_BYTES``, ``KPS``, ...),
so no local name of the launcher is guessed; a launch missing one of them is drift. Groups of
one (MHA), head dims below 16 and FP8 keys with a float32 query keep upstream's kernel. Every
size is a host-side int (fixed grid), so FULL cudagraphs capture it as before. Genesis's PN119
(a backport of vllm#40792) applies a bundled diff guarded by the file's md5; here the kernel is
a reviewed file and the dispatch a codemod on the launch's shape.

Ahead-of-time kernels: the worker runs the patched launcher, so an image selecting PN119
with a GQA preset compiles ``_tq_grouped_decode_stage1`` for its SMs instead of
``_tq_decode_stage1`` (``tests/patchsets/attention_turboquant/test_pn119.py``). Gated to sm_80
and up: the FP8-key path multiplies bf16 tiles with ``tl.dot``.

Verdict on 0.20.1 and 0.33.0: APPLIES. ``_tq_decode_stage1`` and its launch are the same on
both (0.33.0 only changed stage 2's output dtype, outside the rewritten statement). Numerics:
stock and patched stage 1 and the full decode agree within the rounding above on 63 shapes
under Triton's interpreter (the test's docstring gives the bounds).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0): APPLIES on every one. The launch statement, its keyword arguments and the
``triton_decode_attention`` import are unchanged across the train; no release carries a
grouped stage 1 (vllm#40792 is not merged).
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, NewFile, Patch
from kiln.patch.shapes import func, insert_after, marked, place, statements, with_marker

TARGET = "v1/attention/ops/triton_turboquant_decode.py"
KERNEL = "v1/attention/ops/triton_turboquant_grouped_decode.py"
LAUNCHER = func("triton_turboquant_decode_attention")
WHY = "GQA-grouped stage 1: a KV head's query heads in one program, each cached tile unpacked once"

# Upstream's stage-1 launch: ``_tq_decode_stage1[grid](...)``.
STOCK_LAUNCH = m.SimpleStatementLine(
    body=[m.Expr(value=m.Call(func=m.Subscript(value=m.Name("_tq_decode_stage1"))))]
)
# Keyword arguments of upstream's launch the grouped launch reuses -> its own parameter names.
REUSED = {
    "NUM_KV_SPLITS": "num_kv_splits",
    "KV_GROUP_SIZE": "kv_group_size",
    "MSE_BITS": "mse_bits",
    "MSE_BYTES": "mse_bytes",
    "KPS": "key_packed_size",
    "VQB": "value_quant_bits",
    "VAL_DATA_BYTES": "value_data_bytes",
    "ATTN_SCALE": "scale",
    "KEY_FP8": "key_fp8",
    "NORM_CORRECTION": "norm_correction",
    "FP8_E4B15": "fp8_e4b15",
}
DEFAULTS = {"NORM_CORRECTION": "0", "FP8_E4B15": "0"}  # the stock kernel's own defaults
TENSORS = 6  # q_rot, kv_cache, block_table, seq_lens, centroids, mid_o: the launch's first arguments


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


class AddGroupedKernel(NewFile):
    target = KERNEL
    content = "pn119_files/triton_turboquant_grouped_decode.py"
    patched = (func("tq_grouped_decode_stage1", leading_lines=marked("PN119")),)


class ImportGroupedKernel(Codemod):
    """Import the grouped launcher next to the file's ``triton_decode_attention`` import."""

    target = TARGET
    anchor = (
        m.SimpleStatementLine(
            body=[m.ImportFrom(module=m.Attribute(attr=m.Name("triton_decode_attention")))]
        ),
    )
    patched = (m.SimpleStatementLine(body=[m.ImportFrom()], leading_lines=marked("PN119")),)

    def rewrite(self, node):
        (imported,) = statements(
            """
            from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
                grouped_decode_supports,
                tq_grouped_decode_stage1,
            )
            """
        )
        return insert_after(node, with_marker(imported, "PN119", WHY), blank_line=False)


class RouteGroupedStage1(Codemod):
    """Upstream's stage-1 launch goes in the ``else`` of a grouped launch on the same arguments."""

    target = TARGET
    anchor = (LAUNCHER, STOCK_LAUNCH)
    patched = (LAUNCHER, m.If(leading_lines=marked("PN119")))

    def rewrite(self, node):
        call = node.body[0].value
        positional = [a for a in call.args if a.keyword is None]
        keywords = {a.keyword.value: _code(a.value) for a in call.args if a.keyword is not None}
        if len(positional) < TENSORS:
            raise ValueError(f"_tq_decode_stage1 launch has {len(positional)} positional arguments, not >= {TENSORS}")
        missing = sorted(k for k in (*REUSED, "HEAD_DIM") if k not in keywords and k not in DEFAULTS)
        if missing:
            raise ValueError(f"_tq_decode_stage1 launch passes no {', '.join(missing)}")
        tensors = [_code(a.value) for a in positional[:TENSORS]]
        query = tensors[0] if m.matches(positional[0].value, m.Name()) else f"({tensors[0]})"
        arguments = [*tensors, *(f"{name}={keywords.get(kw, DEFAULTS.get(kw))}" for kw, name in REUSED.items())]
        (dispatch,) = statements(
            f"if grouped_decode_supports({keywords['KV_GROUP_SIZE']}, {keywords['HEAD_DIM']}, "
            f"{keywords['KEY_FP8']}, {query}.dtype):\n"
            "    tq_grouped_decode_stage1(\n"
            + "".join(f"        {argument},\n" for argument in arguments)
            + "    )\n"
            "else:\n"
            "    pass\n"
        )
        stock = node.with_changes(leading_lines=[])
        dispatch = dispatch.with_changes(orelse=dispatch.orelse.with_changes(
            body=dispatch.orelse.body.with_changes(body=[stock])))
        return with_marker(dispatch.with_changes(leading_lines=node.leading_lines), "PN119", WHY)


class PN119(Patch):
    id = "PN119"
    family = "attention_turboquant"
    title = "TurboQuant decode stage 1 grouped per KV head (GQA): each cached tile unpacked once"
    why = (
        "Upstream's TurboQuant decode stage 1 runs one program per query head, so every cached "
        "key/value is loaded and unpacked Hq/Hk times. A grouped kernel scores a KV head's query "
        "heads in one program with tl.dot; groups of one keep upstream's kernel."
    )
    upstream_refs = ("vllm#40792",)
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",), sm_min=80)
    perf_critical = True
    edits = (AddGroupedKernel, ImportGroupedKernel, RouteGroupedStage1)

    def upstream_fix(self, module_of) -> str | None:
        """vLLM's own grouped stage 1 (vllm#40792 names it ``_tq_grouped_decode_stage1``).

        An unmarked Triton kernel in the decode file whose name says "grouped" and that the
        launcher launches: upstream batches a KV head's query heads itself.
        """
        module = module_of(TARGET)
        if module is None:
            return None
        launcher = next((n for n in module.body if m.matches(n, LAUNCHER)), None)
        if launcher is None:
            return None
        for node in module.body:
            if not (isinstance(node, cst.FunctionDef) and "grouped" in node.name.value):
                continue
            if m.matches(node, func(node.name.value, leading_lines=marked("PN119"))):
                continue
            if m.findall(launcher, m.Call(func=m.Subscript(value=m.Name(node.name.value)))):
                return (f"{place(TARGET, module, node)}: {node.name.value} scores a KV head's query heads in "
                        f"one program, launched by triton_turboquant_decode_attention (vllm#40792)")
        return None
