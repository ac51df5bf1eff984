"""P60: GDN rows decoded without drafts right after a speculative step resume from the accepted state.

What fails without it (0.20.1). With speculative decoding a GDN (gated delta net) layer keeps
``num_spec + 1`` state slots per request. A verify step writes the SSM state after each
position to block columns ``0..num_spec`` and rolls the conv window forward in column 0; the
accepted-token count decides which is authoritative: SSM state in column ``num_accepted - 1``,
conv window starting at token offset ``num_accepted - 1``. Only the speculative path reads
the state that way. An n-gram proposer often has no draft for a request, and then the next
step runs it on the non-speculative path, which reads column 0 at offset 0: the state from
before the accepted tokens. Nothing fails loudly; the recurrent state silently loses tokens and
outputs degrade (tool-call corruption, vllm#39273). This happens when the whole step has no
drafts (``GPUModelRunner._build_attention_metadata`` then passes nothing to the GDN builder),
when every drafted row drafted zero tokens (``GDNAttentionMetadataBuilder.build`` then takes
its non-spec branch), and in mixed steps, where rows without drafts run as prefills.

What the patch does (a backport of the idea of vllm#40738, written for this tree):
- the model runner passes last step's ``num_accepted_tokens`` to GDN builders on steps
  without drafts too (``_build_attn_group_metadata``);
- the builder computes, for the non-spec rows, ``spec_decode_src_indices`` (the block holding
  the accepted SSM state) and ``non_spec_num_accepted`` (the conv offset + 1), clamped to 1 for
  rows whose last sample was discarded (partial prefill chunks); for FULL-cudagraph decode
  batches both go through persistent buffers, like the other index tensors;
- ``_forward_core`` and the packed decode fast path copy the accepted SSM state into the
  row's column 0 before any kernel reads it, and the single-token conv update reads its window
  at the accepted offset (``causal_conv1d_update`` already supports ``num_accepted_tokens``).
Rows that did not draft have ``num_accepted_tokens == 1``: the copy is a self-copy and the
offset is 0, so their results are unchanged. The copy costs one SSM state per non-spec row and
layer on such steps (decode batches where every row drafts, the usual MTP case, have no
non-spec rows and copy nothing). Compared with Genesis' version of the PR, this one also
covers rows without drafts in mixed steps, the conv offset of the decode paths, and FULL
cudagraph replays (persistent buffers). Decode rows that run through the prefill conv
kernel (mixed steps) also need the offset inside ``_causal_conv1d_fwd_kernel``: that is P60b.
Everything is a runtime guard on ``use_spec_decode`` / a speculative config: images whose
model does not draft are unaffected.

0.33.0: UPSTREAM, fixed in another shape (found by ``upstream_fix``, not by anchors). The GDN
layer moved to ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py`` (so
``gdn_linear_attn.py`` is gone and the anchors would report TARGET_GONE), but that is not the
reason to stop: ``GPUModelRunner`` in ``v1/worker/gpu_model_runner.py`` now sets
``use_spec_decode = self.speculative_config is not None`` and marks decode rows without drafts
as speculative rows with zero drafts (``num_decode_draft_tokens[...] = 0``, the
``zero_draft_decode_mask``; model runner V2 does the same in
``v1/worker/gpu/model_states/mamba_hybrid.py``), and ``GDNAttentionMetadataBuilder.build``
no longer falls back to the non-spec branch when all drafts are zero. So every decode row
takes the speculative path, whose kernels apply the accepted offset to both states (the
approach of vllm#56531). Only prompt chunks stay non-speculative, and they carry no offset.
``spec_decode_src_indices`` (the shape of vllm#40738) is not in 0.33.0; the research note
expected DRIFTED, but the source carries the fix.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.21.0: APPLIES.
- 0.22.0-0.31.0: TARGET_GONE. vllm#41126 (the Mamba attention module refactor) split
  ``model_executor/layers/mamba/gdn_linear_attn.py`` into the ``gdn/`` package
  (``GatedDeltaNetAttention`` in ``gdn/base.py``, Qwen's layer in
  ``gdn/qwen_gdn_linear_attn.py``). The failure is still there: ``GPUModelRunner`` sets
  ``use_spec_decode`` from the step's scheduled drafts (``gpu_model_runner.py:2128`` on 0.22.0)
  and ``spec_decode_src_indices`` never lands. The patch needs re-targeting, not retiring.
- 0.32.0 on: UPSTREAM. ``GPUModelRunner`` sets ``use_spec_decode = self.speculative_config is
  not None`` and gives draftless decode rows 0 drafts (``gpu_model_runner.py:2220`` on
  0.32.0), and ``GDNAttentionMetadataBuilder.build`` keeps them on the spec path
  (``gdn_attn.py:288``): the approach of vllm#56531.
"""

import textwrap

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import assign_to, cls, func, marked, marker_line, place, statements

GDN_ATTN = "v1/attention/backends/gdn_attn.py"
GDN_LAYER = "model_executor/layers/mamba/gdn_linear_attn.py"
RUNNER = "v1/worker/gpu_model_runner.py"

METADATA = cls("GDNAttentionMetadata")
BUILDER = cls("GDNAttentionMetadataBuilder")
LAYER = cls("GatedDeltaNetAttention")
RUNNER_CLS = cls("GPUModelRunner")

WHY = "rows decoded without drafts right after a spec step resume from the accepted state"


def _statements(source: str) -> list[cst.BaseStatement]:
    """Like ``shapes.statements``, but a comment above the first statement stays attached to it."""
    return statements("pass\n" + textwrap.dedent(source).strip("\n"))[1:]


def _marked_line(*body) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(body=list(body), leading_lines=marked("P60"))


def _mark(node: cst.BaseStatement, why: str, *, blank: bool = False) -> cst.BaseStatement:
    """``node`` with the P60 marker above its own comments (and below its blank lines)."""
    lines = list(node.leading_lines)
    head = next((i for i, line in enumerate(lines) if line.comment is not None), len(lines))
    spacer = [cst.EmptyLine(indent=False)] if blank and head == 0 else []
    return node.with_changes(leading_lines=[*lines[:head], *spacer, marker_line("P60", why), *lines[head:]])


def _assign(name: str, value: m.BaseMatcherNode | None = None) -> m.Assign:
    return m.Assign(targets=[m.AssignTarget(target=m.Name(name))], value=value or m.DoNotCare())


def _with_kwarg(call: cst.Call, keyword: str, value: str, *, before: str | None = None) -> cst.Call:
    """``call`` with ``keyword=value`` added before the argument named ``before`` (else last)."""
    args = list(call.args)
    at = next((i for i, a in enumerate(args) if a.keyword and a.keyword.value == before), len(args))
    comma = (args[at - 1] if at else args[0]).comma
    spacing = getattr(comma, "whitespace_after", None)
    if isinstance(spacing, cst.ParenthesizedWhitespace):  # keep the layout, drop its comment
        comma = comma.with_changes(whitespace_after=spacing.with_changes(first_line=cst.TrailingWhitespace()))
    new = cst.Arg(
        keyword=cst.Name(keyword),
        value=cst.parse_expression(value),
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        ),
        comma=comma,
    )
    if at == len(args) and args and args[-1].comma is cst.MaybeSentinel.DEFAULT:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    args.insert(at, new)
    return call.with_changes(args=args)


def _call_of(statement: cst.SimpleStatementLine) -> cst.Call:
    return statement.body[0].value


def _replace_call(statement: cst.SimpleStatementLine, call: cst.Call) -> cst.SimpleStatementLine:
    return statement.with_changes(body=[statement.body[0].with_changes(value=call)])


# --- v1/attention/backends/gdn_attn.py -------------------------------------------------------


class MetadataCarriesRecoveryRows(Codemod):
    """Two fields on ``GDNAttentionMetadata``, right after ``num_accepted_tokens``."""

    target = GDN_ATTN
    anchor = (METADATA, assign_to("num_accepted_tokens"))
    patched = (METADATA, _marked_line(m.AnnAssign(target=m.Name("spec_decode_src_indices"))))

    def rewrite(self, node):
        first, second = _statements(
            """
            # block holding each non-spec row's accepted SSM state, shape: [num non-spec rows,]
            spec_decode_src_indices: torch.Tensor | None = None
            # accepted-token count of each non-spec row (conv window offset + 1)
            non_spec_num_accepted: torch.Tensor | None = None
            """
        )
        return cst.FlattenSentinel([node, _mark(first, WHY, blank=True), second])


class BuilderAllocatesRecoveryBuffers(Codemod):
    """Persistent buffers for the recovery rows, next to the builder's other cudagraph buffers."""

    target = GDN_ATTN
    anchor = (
        BUILDER,
        func("__init__"),
        m.SimpleStatementLine(
            body=[m.AnnAssign(target=m.Attribute(value=m.Name("self"), attr=m.Name("num_accepted_tokens")))]
        ),
    )
    patched = (
        BUILDER,
        func("__init__"),
        _marked_line(m.AnnAssign(target=m.Attribute(attr=m.Name("spec_decode_src_indices")))),
    )

    def rewrite(self, node):
        first, second = _statements(
            """
            self.spec_decode_src_indices: torch.Tensor = torch.empty(
                (self.decode_cudagraph_max_bs,), dtype=torch.int32, device=device
            )
            self.non_spec_num_accepted: torch.Tensor = torch.empty(
                (self.decode_cudagraph_max_bs,), dtype=torch.int32, device=device
            )
            """
        )
        why = "recovery rows of decode-only batches, in persistent buffers for FULL cudagraphs"
        return cst.FlattenSentinel([node, _mark(first, why, blank=True), second])


class BuilderComputesRecoveryRows(Codemod):
    """Around the spec/non-spec split of ``build``: keep the runner's counts, derive the rows."""

    target = GDN_ATTN
    anchor = (
        BUILDER,
        func("build"),
        m.If(
            test=m.Comparison(
                left=m.Name("spec_sequence_masks"),
                comparisons=[m.ComparisonTarget(operator=m.Is(), comparator=m.Name("None"))],
            )
        ),
    )
    patched = (BUILDER, func("build"), _marked_line(_assign("accepted_last_step")))

    def rewrite(self, node):
        (keep,) = statements("accepted_last_step = num_accepted_tokens if self.use_spec_decode else None")
        keep = _mark(keep, "last step's accepted-token counts, before the branches below narrow them")
        keep = keep.with_changes(leading_lines=[*node.leading_lines, *keep.leading_lines])
        derive = _statements(
            """
            # a row without drafts resumes from its last accepted token: SSM state in block
            # column num_accepted - 1, conv window at offset num_accepted - 1. Rows that did not
            # draft have 1; a discarded sample (partial prefill chunk) gives 0, read as 1.
            spec_decode_src_indices = None
            non_spec_num_accepted = None
            if accepted_last_step is not None and non_spec_state_indices_tensor is not None:
                non_spec_num_accepted = accepted_last_step[: block_table_tensor.size(0)].clamp(min=1)
                non_spec_blocks = block_table_tensor
                if spec_sequence_masks_cpu is not None:
                    non_spec_num_accepted = non_spec_num_accepted[~spec_sequence_masks_cpu]
                    non_spec_blocks = block_table_tensor[~spec_sequence_masks_cpu]
                spec_decode_src_indices = non_spec_blocks.gather(
                    1, (non_spec_num_accepted - 1).long().unsqueeze(1)
                ).squeeze(1)
            """
        )
        derive[0] = _mark(derive[0], "locate each non-spec row's accepted state", blank=True)
        return cst.FlattenSentinel([keep, node.with_changes(leading_lines=[]), *derive])


class BuilderPersistsRecoveryRows(Codemod):
    """In the FULL-cudagraph block for decode-only batches, after the state indices are padded."""

    target = GDN_ATTN
    anchor = (
        BUILDER,
        func("build"),
        m.SimpleStatementLine(
            body=[
                m.Expr(
                    value=m.Call(
                        func=m.Attribute(
                            value=m.Subscript(value=m.Name("non_spec_state_indices_tensor")),
                            attr=m.Name("fill_"),
                        )
                    )
                )
            ]
        ),
    )
    patched = (BUILDER, func("build"), m.If(test=m.Comparison(left=m.Name("spec_decode_src_indices")), leading_lines=marked("P60")))

    def rewrite(self, node):
        (block,) = statements(
            """
            if spec_decode_src_indices is not None:
                self.spec_decode_src_indices[:num_decodes].copy_(
                    spec_decode_src_indices[:num_decodes], non_blocking=True
                )
                spec_decode_src_indices = self.spec_decode_src_indices[:batch_size]
                spec_decode_src_indices[num_decodes:].fill_(NULL_BLOCK_ID)
                self.non_spec_num_accepted[:num_decodes].copy_(
                    non_spec_num_accepted[:num_decodes], non_blocking=True
                )
                non_spec_num_accepted = self.non_spec_num_accepted[:batch_size]
                non_spec_num_accepted[num_decodes:].fill_(1)
            """
        )
        why = "recovery rows go through the persistent buffers too (padding: null block onto itself)"
        return cst.FlattenSentinel([node, _mark(block, why, blank=True)])


class BuilderPassesRecoveryRows(Codemod):
    """The two new fields in the ``GDNAttentionMetadata(...)`` that ``build`` returns."""

    target = GDN_ATTN
    anchor = (BUILDER, func("build"), assign_to("attn_metadata"))
    patched = (BUILDER, func("build"), _marked_line(_assign("attn_metadata")))

    def rewrite(self, node):
        call = _call_of(node)
        call = _with_kwarg(call, "spec_decode_src_indices", "spec_decode_src_indices", before="nums_dict")
        call = _with_kwarg(call, "non_spec_num_accepted", "non_spec_num_accepted", before="nums_dict")
        return _mark(_replace_call(node, call), "carry the recovery rows to the layers")


# --- model_executor/layers/mamba/gdn_linear_attn.py ------------------------------------------

PRE_COPY = """
spec_decode_src_indices = attn_metadata.spec_decode_src_indices
if spec_decode_src_indices is not None:
    assert non_spec_state_indices_tensor is not None
    ssm_state[non_spec_state_indices_tensor[: spec_decode_src_indices.size(0)]] = ssm_state[
        spec_decode_src_indices
    ]
"""
PRE_COPY_WHY = "copy each non-spec row's accepted SSM state into the block the kernels read"
CONV_WHY = "read the conv window at the accepted-token offset (the update kernel supports it)"


def _conv_update_call(target_name: str = "mixed_qkv_non_spec") -> m.SimpleStatementLine:
    return m.SimpleStatementLine(body=[_assign(target_name, m.Call(func=m.Name("causal_conv1d_update")))])


class _PreCopy(Codemod):
    def rewrite(self, node):
        first, second = _statements(PRE_COPY)
        return cst.FlattenSentinel([node, _mark(first, PRE_COPY_WHY, blank=True), second])


class _ConvOffset(Codemod):
    def rewrite(self, node):
        call = _with_kwarg(
            _call_of(node), "num_accepted_tokens", "attn_metadata.non_spec_num_accepted", before="validate_data"
        )
        return _mark(_replace_call(node, call), CONV_WHY)


class CoreRestoresAcceptedSsmState(_PreCopy):
    """``_forward_core``: the copy, before the conv and recurrent kernels of every path."""

    target = GDN_LAYER
    anchor = (LAYER, func("_forward_core"), assign_to("num_accepted_tokens"))
    patched = (LAYER, func("_forward_core"), _marked_line(_assign("spec_decode_src_indices")))


class CoreDecodeConvReadsAcceptedWindow(_ConvOffset):
    """``_forward_core``: the non-spec decode branch's ``causal_conv1d_update``."""

    target = GDN_LAYER
    anchor = (LAYER, func("_forward_core"), _conv_update_call())
    patched = (LAYER, func("_forward_core"), _marked_line(_assign("mixed_qkv_non_spec")))


class PackedDecodeRestoresAcceptedSsmState(_PreCopy):
    """``_forward_core_decode_non_spec`` (packed fast path, taken on steps without drafts)."""

    target = GDN_LAYER
    anchor = (LAYER, func("_forward_core_decode_non_spec"), assign_to("num_actual_tokens"))
    patched = (LAYER, func("_forward_core_decode_non_spec"), _marked_line(_assign("spec_decode_src_indices")))


class PackedDecodeConvReadsAcceptedWindow(_ConvOffset):
    """``_forward_core_decode_non_spec``: its ``causal_conv1d_update``."""

    target = GDN_LAYER
    anchor = (LAYER, func("_forward_core_decode_non_spec"), _conv_update_call())
    patched = (LAYER, func("_forward_core_decode_non_spec"), _marked_line(_assign("mixed_qkv_non_spec")))


# --- v1/worker/gpu_model_runner.py -------------------------------------------------------------

GROUP_METADATA = (RUNNER_CLS, func("_build_attention_metadata"), func("_build_attn_group_metadata"))


class RunnerPassesAcceptedCounts(Codemod):
    """``elif`` on the spec-decode branch that hands ``num_accepted_tokens`` to GDN builders."""

    target = RUNNER
    anchor = (*GROUP_METADATA, m.If(test=m.BooleanOperation(left=m.Name("use_spec_decode")), orelse=None))
    patched = (*GROUP_METADATA, _marked_line(_assign("extra_attn_metadata_args")))

    def rewrite(self, node):
        (shape,) = statements(
            """
            if _:
                pass
            elif (
                self.speculative_config is not None
                and ubid is None
                and isinstance(builder, GDNAttentionMetadataBuilder)
            ):
                extra_attn_metadata_args = dict(
                    num_accepted_tokens=self.num_accepted_tokens.gpu[:num_reqs_padded],
                )
            """
        )
        branch = shape.orelse
        (assign,) = branch.body.body
        why = "a step without drafts still tells GDN what each row accepted last step"
        branch = branch.with_changes(body=branch.body.with_changes(body=[_mark(assign, why)]))
        return node.with_changes(orelse=branch)


# --- upstream detection --------------------------------------------------------------------------

SPEC_FOR_EVERY_STEP = m.SimpleStatementLine(
    body=[
        _assign(
            "use_spec_decode",
            m.Comparison(
                left=m.Attribute(value=m.Name("self"), attr=m.Name("speculative_config")),
                comparisons=[m.ComparisonTarget(operator=m.IsNot(), comparator=m.Name("None"))],
            ),
        )
    ]
)
ZERO_DRAFT_ROWS = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Subscript(value=m.Name("num_decode_draft_tokens")))],
            value=m.Integer("0"),
        )
    ]
)
UNMARKED_SRC_FIELD = m.SimpleStatementLine(
    body=[m.AnnAssign(target=m.Name("spec_decode_src_indices"))],
    leading_lines=m.MatchIfTrue(
        lambda lines: not any(line.comment and line.comment.value.startswith("# kiln P60:") for line in lines)
    ),
)


def _runner_routes_zero_draft_rows(runner: cst.Module) -> str | None:
    """``file:line`` of a runner method that treats every step as speculative and gives
    draftless decode rows 0 drafts."""
    for klass in find(runner, RUNNER_CLS):
        for method in find(klass, m.FunctionDef()):
            zero = find(method, ZERO_DRAFT_ROWS)  # (first: the rarer shape, so most methods are walked once)
            if zero and find(method, SPEC_FOR_EVERY_STEP):
                return place(RUNNER, runner, zero[0])
    return None


def _builder_keeps_zero_draft_rows(gdn_attn: cst.Module) -> str | None:
    """``file:line`` where ``build`` picks spec rows from the draft counts, when it does so
    without the 'all drafts are zero' fallback."""
    ifs = [
        node
        for klass in find(gdn_attn, BUILDER)
        for method in find(klass, func("build"))
        for node in find(method, m.If())
        if m.findall(node.test, m.Name("num_decode_draft_tokens_cpu"))
    ]
    if not ifs or any(m.findall(n.test, m.Call(func=m.Attribute(attr=m.Name("sum")))) for n in ifs):
        return None
    return place(GDN_ATTN, gdn_attn, ifs[0])


class P60(Patch):
    id = "P60"
    family = "attention_gdn"
    title = "GDN + n-gram spec decode: resume draftless rows from the accepted SSM/conv state"
    why = (
        "After a speculative step that accepted draft tokens, a GDN row decoded without drafts "
        "reads its SSM state from block column 0 and its conv window at offset 0, i.e. the state "
        "from before the accepted tokens; outputs silently degrade. Restore the accepted state."
    )
    upstream_refs = ("vllm#40738", "vllm#39273", "vllm#56531")
    written_for = ">=0.20.1"
    gates = Gates(
        architectures=("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    )
    edits = (
        MetadataCarriesRecoveryRows,
        BuilderAllocatesRecoveryBuffers,
        BuilderComputesRecoveryRows,
        BuilderPersistsRecoveryRows,
        BuilderPassesRecoveryRows,
        CoreRestoresAcceptedSsmState,
        CoreDecodeConvReadsAcceptedWindow,
        PackedDecodeRestoresAcceptedSsmState,
        PackedDecodeConvReadsAcceptedWindow,
        RunnerPassesAcceptedCounts,
    )

    def upstream_fix(self, module_of):
        runner, gdn_attn = module_of(RUNNER), module_of(GDN_ATTN)
        if runner is None or gdn_attn is None:
            return None
        routed, kept = _runner_routes_zero_draft_rows(runner), _builder_keeps_zero_draft_rows(gdn_attn)
        if routed and kept:
            return (
                f"{routed}: GPUModelRunner runs every step of a spec config as speculative and gives "
                f"draftless decode rows 0 drafts; {kept}: GDNAttentionMetadataBuilder.build keeps such "
                "rows on the spec path, whose kernels read the accepted state (vllm#56531)"
            )
        for klass in find(gdn_attn, METADATA):
            fields = find(klass, UNMARKED_SRC_FIELD)
            if fields:
                return (
                    f"{place(GDN_ATTN, gdn_attn, fields[0])}: GDNAttentionMetadata.spec_decode_src_indices "
                    "(vllm#40738) is present"
                )
        return None
