"""P60b: the prefill conv kernel reads a decode row's conv window at its accepted-token offset.

What fails without it (0.20.1). P60 restores the state of rows decoded without drafts right
after a speculative step, but one path stays wrong: in a step that mixes rows with drafts and
rows without, GDN runs the rows without drafts as 1-token prefills through
``causal_conv1d_fn`` (``_forward_core``), and ``_causal_conv1d_fwd_kernel`` always reads the
previous conv window at ``state_len - 1`` and shifts it from token 0. After a verify step the
valid window starts at token ``num_accepted_tokens - 1`` of the (longer, ``width - 1 +
num_spec``) conv state, so those rows convolve stale tokens and write a stale window back.

What the patch does (the kernel half of vllm#40738, written for this tree):
- ``_causal_conv1d_fwd_kernel`` takes ``num_accepted_tokens_ptr`` (positional, after
  ``num_computed_tokens``) and ``IS_SPEC_DECODING: tl.constexpr``; when set, it loads
  ``conv_state_token_offset = num_accepted - 1`` for the row (after the padding-row early
  return, so padding never reads it) and adds it where it reads the old window: the prior
  tokens (STEP 1) and the source of the shift-left (STEP 2, ``load_init_state`` branch). The
  window it writes back starts at token 0, i.e. it is normalised, as after a non-spec step.
  Rows without initial state never read the window, so the offset does not touch them.
- ``causal_conv1d_fn`` takes ``num_accepted_tokens=None`` and passes it with
  ``IS_SPEC_DECODING=num_accepted_tokens is not None``; every other caller (Mamba2, KDA,
  short conv, ...) passes nothing and compiles the unchanged kernel (constexpr False).
- ``_forward_core`` passes ``attn_metadata.non_spec_num_accepted`` (from P60; ``None`` without
  a speculative config), aligned with the non-spec rows the kernel's ``idx_seq`` indexes.
The Triton signature changes, so the kernel is recompiled once (new cache key).

0.33.0: GATED ("requires P60, which is UPSTREAM"). The engine checks ``requires`` before
``upstream_fix``, and P60 is fixed upstream there in another shape: the runner routes every
decode row through the speculative path, so no decode row with an offset reaches this kernel
any more (only prompt chunks do, and they carry none); P60b is not needed either. Were P60
applicable, P60b alone would be TARGET_GONE, because ``gdn_linear_attn.py`` is gone (the layer
is now ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``), and its kernel anchors
drift too: ``_causal_conv1d_fwd_kernel`` lost ``initial_state_idx``/``num_computed_tokens``
and ``IS_APC_ENABLED`` (prefix caching moved out of this kernel) and ``causal_conv1d_fn`` lost
``num_computed_tokens`` (the test names each missing parameter). The research note's DRIFTED
is true of the kernel, but not the whole story. ``num_accepted_tokens_ptr`` (vllm#40738's own
shape, which ``upstream_fix`` looks for) is not in the 0.33.0 kernel.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.21.0: APPLIES.
- 0.22.0 on: GATED, following P60: "requires P60, which is TARGET_GONE" to 0.31.0 (the GDN
  layer moved, vllm#41126), "... which is UPSTREAM" from 0.32.0 (no decode row with an offset
  reaches the prefill conv kernel). ``num_accepted_tokens_ptr`` (vllm#40738) is in no release.
"""

import dataclasses

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import cls, func, marked, marker_line, place

CONV = "model_executor/layers/mamba/ops/causal_conv1d.py"
GDN_LAYER = "model_executor/layers/mamba/gdn_linear_attn.py"
KERNEL = func("_causal_conv1d_fwd_kernel")
LAUNCHER = func("causal_conv1d_fn")
LAYER = cls("GatedDeltaNetAttention")
PREFIX = "# kiln P60b:"


def _mark(node: cst.BaseStatement, why: str) -> cst.BaseStatement:
    """``node`` with the P60b marker below its blank lines and above its own comments."""
    lines = list(node.leading_lines)
    head = next((i for i, line in enumerate(lines) if line.comment is not None), len(lines))
    return node.with_changes(leading_lines=[*lines[:head], marker_line("P60b", why), *lines[head:]])


def _marked_param(name: str) -> m.Param:
    """A parameter carrying the P60b marker as its trailing comment."""
    comment = m.Comment(m.MatchIfTrue(lambda text: text.startswith(PREFIX)))
    return m.Param(
        name=m.Name(name),
        comma=m.Comma(whitespace_after=m.ParenthesizedWhitespace(first_line=m.TrailingWhitespace(comment=comment))),
    )


def _param_after(param: cst.Param, name: str, why: str, annotation: str | None = None, default: str | None = None):
    """Keep ``param`` and add ``name`` after it, laid out like it, with the marker as comment."""
    comma = param.comma
    spacing = comma.whitespace_after
    assert isinstance(spacing, cst.ParenthesizedWhitespace), "parameters are one per line"
    first_line = cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(f"{PREFIX} {why}"))
    new = param.with_changes(
        name=cst.Name(name),
        annotation=cst.Annotation(cst.parse_expression(annotation)) if annotation else None,
        default=cst.parse_expression(default) if default else None,
        equal=cst.AssignEqual() if default else cst.MaybeSentinel.DEFAULT,
        comma=comma.with_changes(whitespace_after=spacing.with_changes(first_line=first_line)),
    )
    return cst.FlattenSentinel([param, new])


def _plus_offset(expr: cst.BinaryOperation) -> cst.BinaryOperation:
    """``(a + b)`` -> ``(a + b + conv_state_token_offset)``, keeping the parentheses."""
    return cst.BinaryOperation(
        left=expr.with_changes(lpar=[], rpar=[]),
        operator=cst.Add(),
        right=cst.Name("conv_state_token_offset"),
        lpar=expr.lpar,
        rpar=expr.rpar,
    )


def _marked(line: m.SimpleStatementLine) -> m.SimpleStatementLine:
    """The same statement matcher, preceded by the P60b marker."""
    return dataclasses.replace(line, leading_lines=marked("P60b"))


def _exactly_one(matcher: m.BaseMatcherNode) -> m.MatchIfTrue:
    return m.MatchIfTrue(lambda node: len(m.findall(node, matcher)) == 1)


# --- model_executor/layers/mamba/ops/causal_conv1d.py: the kernel ------------------------------


class KernelTakesAcceptedCounts(Codemod):
    """Pointer parameter after ``num_computed_tokens`` (the launcher passes it positionally)."""

    target = CONV
    anchor = (KERNEL, m.Param(name=m.Name("num_computed_tokens")))
    patched = (KERNEL, _marked_param("num_accepted_tokens_ptr"))

    def rewrite(self, node):
        return _param_after(node, "num_accepted_tokens_ptr", "(batch,) tokens accepted by the last spec step, or None")


class KernelKnowsSpecDecoding(Codemod):
    """``IS_SPEC_DECODING: tl.constexpr`` next to ``IS_APC_ENABLED`` (passed by keyword)."""

    target = CONV
    anchor = (KERNEL, m.Param(name=m.Name("IS_APC_ENABLED")))
    patched = (KERNEL, _marked_param("IS_SPEC_DECODING"))

    def rewrite(self, node):
        return _param_after(node, "IS_SPEC_DECODING", "num_accepted_tokens_ptr is set", annotation="tl.constexpr")


PAD_ROW_RETURN = m.If(
    test=m.Comparison(
        left=m.Name("idx_seq"), comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Name("pad_slot_id"))]
    )
)


class KernelLoadsWindowOffset(Codemod):
    """The row's window offset, right after padding rows have returned."""

    target = CONV
    anchor = (KERNEL, PAD_ROW_RETURN)
    patched = (KERNEL, m.If(test=m.Name("IS_SPEC_DECODING"), leading_lines=marked("P60b")))

    def rewrite(self, node):
        offset = cst.parse_statement(
            "if IS_SPEC_DECODING:\n"
            "    conv_state_token_offset = tl.load(num_accepted_tokens_ptr + idx_seq).to(tl.int64) - 1\n"
            "else:\n"
            "    conv_state_token_offset = 0\n"
        )
        offset = offset.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        why = "a row decoded right after a spec step keeps its conv window at num_accepted - 1"
        return cst.FlattenSentinel([node, _mark(offset, why)])


STATE_LEN_MINUS_ONE = m.BinaryOperation(left=m.Name("state_len"), operator=m.Subtract(), right=m.Integer("1"))
PRIOR_TOKENS = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("prior_tokens"))],
            value=m.BinaryOperation(left=m.Name("conv_states_base")) & _exactly_one(STATE_LEN_MINUS_ONE),
        )
    ]
)


class KernelReadsAcceptedWindow(Codemod):
    """STEP 1: the prior tokens are read from the accepted window, not from token 0."""

    target = CONV
    anchor = (KERNEL, PRIOR_TOKENS)
    patched = (KERNEL, _marked(PRIOR_TOKENS))

    def rewrite(self, node):
        new = m.replace(node, STATE_LEN_MINUS_ONE, lambda found, _: _plus_offset(found))
        return _mark(new, "read the previous window at the accepted-token offset")


TOKENS_PLUS_SEQLEN = m.BinaryOperation(left=m.Name("idx_tokens_conv"), operator=m.Add(), right=m.Name("seqlen"))
SHIFT_SOURCE = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("conv_states_ptrs_source"))],
            value=_exactly_one(TOKENS_PLUS_SEQLEN),
        )
    ]
)


class KernelShiftsFromAcceptedWindow(Codemod):
    """STEP 2 (``load_init_state``): the kept part of the old window comes from the same offset."""

    target = CONV
    anchor = (KERNEL, SHIFT_SOURCE)
    patched = (KERNEL, _marked(SHIFT_SOURCE))

    def rewrite(self, node):
        new = m.replace(node, TOKENS_PLUS_SEQLEN, lambda found, _: _plus_offset(found))
        return _mark(new, "shift the old window from the accepted-token offset; the result starts at 0")


# --- the launcher ------------------------------------------------------------------------------


class LauncherTakesAcceptedCounts(Codemod):
    """``causal_conv1d_fn(..., num_accepted_tokens=None)``; every caller passes keywords here."""

    target = CONV
    anchor = (LAUNCHER, m.Param(name=m.Name("num_computed_tokens")))
    patched = (LAUNCHER, _marked_param("num_accepted_tokens"))

    def rewrite(self, node):
        why = "(batch,) tokens accepted by the last spec step, or None"
        return _param_after(node, "num_accepted_tokens", why, annotation="torch.Tensor | None", default="None")


KERNEL_LAUNCH = m.SimpleStatementLine(
    body=[
        m.Expr(
            value=m.Call(
                func=m.Subscript(value=m.Name("_causal_conv1d_fwd_kernel")),
                args=[
                    m.ZeroOrMore(),
                    m.Arg(keyword=None, value=m.Name("num_computed_tokens")),
                    m.ZeroOrMore(),
                    m.Arg(keyword=m.Name("IS_APC_ENABLED")),
                    m.ZeroOrMore(),
                ],
            )
        )
    ]
)


class LauncherPassesAcceptedCounts(Codemod):
    """The launch passes the pointer in the kernel's order, and the constexpr by keyword."""

    target = CONV
    anchor = (LAUNCHER, KERNEL_LAUNCH)
    patched = (LAUNCHER, _marked(KERNEL_LAUNCH))

    def rewrite(self, node):
        call = node.body[0].value
        args: list[cst.Arg] = []
        for arg in call.args:
            args.append(arg)
            if arg.keyword is None and m.matches(arg.value, m.Name("num_computed_tokens")):
                args.append(arg.with_changes(value=cst.Name("num_accepted_tokens")))
            elif arg.keyword is not None and arg.keyword.value == "IS_APC_ENABLED":
                value = cst.parse_expression("num_accepted_tokens is not None")
                args.append(arg.with_changes(keyword=cst.Name("IS_SPEC_DECODING"), value=value))
        new = node.with_changes(body=[node.body[0].with_changes(value=call.with_changes(args=args))])
        return _mark(new, "pass the accepted-token counts (IS_SPEC_DECODING when given)")


# --- model_executor/layers/mamba/gdn_linear_attn.py --------------------------------------------

PREFILL_CONV = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("mixed_qkv_non_spec"))],
            value=m.Call(func=m.Attribute(value=m.Call(func=m.Name("causal_conv1d_fn")), attr=m.Name("transpose"))),
        )
    ]
)


class GdnPrefillConvPassesAcceptedCounts(Codemod):
    """``_forward_core``'s ``causal_conv1d_fn`` call gets the non-spec rows' counts (from P60)."""

    target = GDN_LAYER
    anchor = (LAYER, func("_forward_core"), PREFILL_CONV)
    patched = (LAYER, func("_forward_core"), _marked(PREFILL_CONV))

    def rewrite(self, node):
        outer = node.body[0].value  # causal_conv1d_fn(...).transpose(0, 1)
        inner = outer.func.value
        args = list(inner.args)
        at = next((i for i, a in enumerate(args) if a.keyword and a.keyword.value == "metadata"), len(args) - 1)
        template = args[at - 1]
        new_arg = template.with_changes(
            keyword=cst.Name("num_accepted_tokens"),
            value=cst.parse_expression("attn_metadata.non_spec_num_accepted"),
        )
        args.insert(at, new_arg)
        outer = outer.with_changes(func=outer.func.with_changes(value=inner.with_changes(args=args)))
        new = node.with_changes(body=[node.body[0].with_changes(value=outer)])
        return _mark(new, "rows decoded here right after a spec step read their conv window at the offset")


class P60b(Patch):
    id = "P60b"
    family = "attention_gdn"
    title = "GDN + n-gram spec decode: prefill conv kernel reads the accepted conv window"
    why = (
        "In steps mixing rows with and without drafts, GDN runs draftless decode rows through "
        "the prefill conv kernel, which reads the conv window at offset 0 instead of the "
        "accepted-token offset left by the previous spec step. Add the offset to the kernel."
    )
    upstream_refs = ("vllm#40738", "vllm#39273")
    requires = ("P60",)
    written_for = ">=0.20.1"
    gates = Gates(
        architectures=("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    )
    edits = (
        KernelTakesAcceptedCounts,
        KernelKnowsSpecDecoding,
        KernelLoadsWindowOffset,
        KernelReadsAcceptedWindow,
        KernelShiftsFromAcceptedWindow,
        LauncherTakesAcceptedCounts,
        LauncherPassesAcceptedCounts,
        GdnPrefillConvPassesAcceptedCounts,
    )

    def upstream_fix(self, module_of):
        conv = module_of(CONV)
        if conv is None:
            return None
        unmarked = m.Param(
            name=m.Name("num_accepted_tokens_ptr"),
            comma=~m.Comma(
                whitespace_after=m.ParenthesizedWhitespace(
                    first_line=m.TrailingWhitespace(comment=m.Comment(m.MatchIfTrue(lambda t: t.startswith(PREFIX))))
                )
            ),
        )
        for kernel in find(conv, KERNEL):
            params = find(kernel, unmarked)
            if params:
                return (
                    f"{place(CONV, conv, params[0])}: _causal_conv1d_fwd_kernel takes "
                    "num_accepted_tokens_ptr (vllm#40738)"
                )
        return None
