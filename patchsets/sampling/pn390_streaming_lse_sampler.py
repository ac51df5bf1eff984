"""PN390: non-greedy spec-decode verification without the full-vocabulary ``target_probs`` tensor.

What costs without the patch (0.20.1, the V1 model runner, its default): when a spec-decode
step holds a request that samples (temperature > 0), ``rejection_sample``
(``v1/sample/rejection_sampler.py:456``) turns the target logits of every draft position into a
full probability tensor, ``target_logits.softmax(dim=-1, dtype=torch.float32)``:
``num_draft_tokens x vocab_size x 4`` bytes, written once and read by two Triton kernels that
use only a few entries of each row (the acceptance test reads one, the recovered-token kernel
reads a whole row once). With Qwen3.6's 248320-token vocabulary that is 0.95 MiB per draft
position: 11.4 MiB at kiln's 4 sequences with K=3 (27B), 18.9 MiB with K=5 (35B-A3B), and
half a GiB at vLLM's default 256 sequences. It is transient memory and memory traffic, not a
wrong result.

What the patch does (vllm#45369's approach, written anew here): one Triton kernel computes each
row's log-sum-exp, ``lse = max + log(sum(exp(x - max)))`` (two passes over the row in 8192-lane
tiles, reading only); ``rejection_random_sample_kernel`` and ``sample_recovered_tokens_kernel``
take the logits and that ``[num_tokens]`` vector instead of ``target_probs`` and form each
probability where they use it, ``p = exp(logit - lse)``, the same softmax up to rounding. Lanes
the pristine kernel loads as ``0.0`` (past the vocabulary, or the draft token itself when there
are no draft probabilities) stay exactly ``0.0`` (``tl.where`` on the load's own mask), so a
NaN row behaves as before and PN378's padding mask composes with it unchanged. The logits are
made contiguous first (a no-op for the V1 forward's fp32 copy, so no allocation there).

Proof, under Triton's interpreter on CPU (``tests/patchsets/sampling/test_pn390.py``): 0.20.1's
real ``rejection_sample``, pristine, patched, PN378 alone and PN378 with PN390, over a grid of
batch sizes, draft lengths, vocabularies (non-powers of two, one of them Qwen3.6's 248320),
temperatures, greedy/random mixes, top-k-style ``-inf`` rows, with draft probabilities and
without (MTP and n-gram pass none on the V1 runner): the same accepted, recovered and bonus
tokens as stock with the same seeds; and no ``(num_tokens, vocab)`` fp32 tensor is allocated on
the patched path (the same probe catches the softmax on pristine).

Verdicts: 0.20.1 APPLIES. 0.33.0 OUT_OF_RANGE: not written for it. From 0.30.0 the kernels
launch through warm-up dispatchers whose warm-up inputs name ``target_probs``
(``_rejection_random_sample``, ``_sample_recovered_tokens``), and 0.33.0 also reads
``target_probs`` for FLy's entropy (``rejection_sampler.py:499-507``); there the V1 sampler is
not what kiln's models run: 0.33.0's V2 model runner verifies drafts in its own chunked sampler
(``v1/worker/gpu/spec_decode/rejection_sampler.py``). vllm#45369 is unmerged: no release up to
0.33.0 carries it (``upstream_fix`` recognises an unmarked per-row ``target_lse`` in
``rejection_sample`` with no softmax, should it land).

Verdicts across releases (``patchsets/release-train.toml``, every release 0.20.1-0.33.0):
- 0.20.1-0.29.0: APPLIES. The rewritten statements are the same on all of them; 0.23.0 adds
  ``use_fp64_gumbel`` (a float64 ``inv_q``, outside the rewritten loads) and 0.24.0 PN378's two
  kernel statements (vllm#44744), which this patch does not touch.
- 0.30.0-0.33.0: OUT_OF_RANGE (the dispatchers above; see the paragraph before).
"""

import dataclasses

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find, reach
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    assign_to,
    func,
    insert_after,
    marked,
    statements,
    top_level,
    with_marker,
)

TARGET = "v1/sample/rejection_sampler.py"
SAMPLE = func("rejection_sample")
RECOVERY = func("sample_recovered_tokens")
ACCEPT_KERNEL = func("rejection_random_sample_kernel")
RECOVERY_KERNEL = func("sample_recovered_tokens_kernel")
WHY = "probabilities are exp(logit - lse) where used, no num_tokens x vocab fp32 softmax"

SOFTMAX = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(m.Name("target_probs"))],
            value=m.Call(func=m.Attribute(value=m.Name("target_logits"), attr=m.Name("softmax"))),
        )
    ]
)
PROBS_CONTIGUOUS = m.SimpleStatementLine(
    body=[m.Assert(test=m.Call(func=m.Attribute(value=m.Name("target_probs"), attr=m.Name("is_contiguous"))))]
)
TAKES_PROBS = m.Arg(value=m.Name("target_probs"))


def _calls_with_probs(callee: m.BaseExpression, **kwargs) -> m.SimpleStatementLine:
    """A statement calling ``callee`` (or launching it, ``callee[grid](...)``) with ``target_probs``."""
    call = m.Call(func=callee, args=[m.ZeroOrMore(), TAKES_PROBS, m.ZeroOrMore()])
    return m.SimpleStatementLine(body=[m.OneOf(m.Expr(value=call), m.Assign(value=call))], **kwargs)


def _calls(callee: m.BaseExpression, **kwargs) -> m.SimpleStatementLine:
    call = m.Call(func=callee)
    return m.SimpleStatementLine(body=[m.OneOf(m.Expr(value=call), m.Assign(value=call))], **kwargs)


def _marked_assign(name: str) -> m.SimpleStatementLine:
    return dataclasses.replace(assign_to(name), leading_lines=marked("PN390"))


RECOVERY_CALL = m.Name("sample_recovered_tokens")
ACCEPT_LAUNCH = m.Subscript(value=m.Name("rejection_random_sample_kernel"))
RECOVERY_LAUNCH = m.Subscript(value=m.Name("sample_recovered_tokens_kernel"))


def _expr(source: str) -> cst.BaseExpression:
    return cst.parse_expression(source)


def _swap_probs_arg(call: cst.Call) -> cst.Call:
    """``f(..., target_probs, ...)`` -> ``f(..., target_logits, target_lse, ...)``."""
    args = []
    for arg in call.args:
        if m.matches(arg, TAKES_PROBS):
            args.append(arg.with_changes(value=cst.Name("target_logits")))
            args.append(arg.with_changes(value=cst.Name("target_lse")))
        else:
            args.append(arg)
    return call.with_changes(args=args)


class _SwapProbsArg(cst.CSTTransformer):
    def leave_Call(self, original_node, updated_node):
        return _swap_probs_arg(updated_node) if m.matches(updated_node, m.Call(args=[m.ZeroOrMore(), TAKES_PROBS, m.ZeroOrMore()])) else updated_node


def _swap_statement(node: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    return with_marker(node.visit(_SwapProbsArg()), "PN390", "pass the logits and their per-row logsumexp")


def _comment(param: cst.Param, text: str) -> cst.Param:
    """``param`` with the trailing comment after its comma (the kernels' shape notes) set to ``text``."""
    after = getattr(param.comma, "whitespace_after", None)
    if not isinstance(after, cst.ParenthesizedWhitespace) or after.first_line.comment is None:
        return param
    first = after.first_line.with_changes(comment=cst.Comment(text))
    return param.with_changes(comma=param.comma.with_changes(whitespace_after=after.with_changes(first_line=first)))


def _params(fn: cst.FunctionDef, old: str, logits: str, lse: str) -> cst.FunctionDef:
    """Replace parameter ``old`` (the probabilities) by ``logits`` and ``lse`` (one value per row)."""
    params = []
    for param in fn.params.params:
        if param.name.value == old:
            params.append(param.with_changes(name=cst.Name(logits)))
            params.append(_comment(param.with_changes(name=cst.Name(lse)), "# [num_tokens]"))
        else:
            params.append(param)
    if len(params) == len(fn.params.params):
        raise ValueError(f"{fn.name.value} has no parameter {old}")
    return fn.with_changes(params=fn.params.with_changes(params=params))


class ComputeLogsumexp(Codemod):
    """``target_probs = target_logits.softmax(...)`` -> the per-row logsumexp."""

    target = TARGET
    anchor = (SAMPLE, SOFTMAX)
    patched = (SAMPLE, _marked_assign("target_lse"))

    def rewrite(self, node):
        contiguous, lse = statements(
            """
            target_logits = target_logits.contiguous()
            target_lse = compute_target_lse(target_logits)
            """
        )
        head = with_marker(contiguous.with_changes(leading_lines=node.leading_lines), "PN390", WHY)
        return cst.FlattenSentinel([head, with_marker(lse, "PN390", "one fp32 value per row")])


class CheckLogsumexp(Codemod):
    """``assert target_probs.is_contiguous()`` -> the same check of what replaces it."""

    target = TARGET
    anchor = (SAMPLE, PROBS_CONTIGUOUS)
    patched = (SAMPLE, m.SimpleStatementLine(body=[m.Assert()], leading_lines=marked("PN390")))

    def rewrite(self, node):
        (check,) = statements("assert target_lse.is_contiguous()")
        return with_marker(check.with_changes(leading_lines=node.leading_lines), "PN390", "the kernels index it by row")


class PassLogitsToRecovery(Codemod):
    target = TARGET
    anchor = (SAMPLE, _calls_with_probs(RECOVERY_CALL))
    patched = (SAMPLE, _calls(RECOVERY_CALL, leading_lines=marked("PN390")))

    def rewrite(self, node):
        return _swap_statement(node)


class PassLogitsToAcceptance(Codemod):
    target = TARGET
    anchor = (SAMPLE, _calls_with_probs(ACCEPT_LAUNCH))
    patched = (SAMPLE, _calls(ACCEPT_LAUNCH, leading_lines=marked("PN390")))

    def rewrite(self, node):
        return _swap_statement(node)


class _Splice(cst.CSTTransformer):
    """Replace statements (by identity) with lists of statements, wherever they are nested."""

    def __init__(self, swaps: dict):
        self.swaps = swaps

    def on_leave(self, original_node, updated_node):
        if original_node in self.swaps:
            return cst.FlattenSentinel(self.swaps[original_node])
        return updated_node


VOCAB_FROM_PROBS = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(m.Name("vocab_size"))], value=m.Subscript(
        value=m.Attribute(value=m.Name("target_probs"), attr=m.Name("shape"))))]
)


class RecoveryTakesLogits(Codemod):
    """``sample_recovered_tokens(..., target_probs, ...)`` takes the logits and their logsumexp."""

    target = TARGET
    anchor = (RECOVERY,)
    patched = (RECOVERY, _marked_assign("vocab_size"))

    def rewrite(self, node):
        fn = _params(node, "target_probs", "target_logits", "target_lse")
        (vocab,) = find(fn, VOCAB_FROM_PROBS)
        (launch,) = find(fn, _calls_with_probs(RECOVERY_LAUNCH))
        (new_vocab,) = statements("vocab_size = target_logits.shape[-1]")
        new_vocab = with_marker(new_vocab.with_changes(leading_lines=vocab.leading_lines), "PN390", WHY)
        return fn.visit(_Splice({vocab: [new_vocab], launch: [_swap_statement(launch)]}))


class AddLogsumexpKernel(Codemod):
    """``compute_target_lse`` and its kernel, after ``sample_recovered_tokens``."""

    target = TARGET
    anchor = (RECOVERY,)
    patched = (func("compute_target_lse", leading_lines=marked("PN390")),)

    def rewrite(self, node):
        helper, kernel = statements(
            '''
            def compute_target_lse(target_logits: torch.Tensor) -> torch.Tensor:
                """Per-row logsumexp of [num_tokens, vocab_size] logits, as fp32 [num_tokens]."""
                num_tokens, vocab_size = target_logits.shape
                target_lse = torch.empty(
                    (num_tokens,), dtype=torch.float32, device=target_logits.device
                )
                if num_tokens > 0:
                    target_lse_kernel[(num_tokens,)](
                        target_lse, target_logits, vocab_size, BLOCK_SIZE=8192
                    )
                return target_lse

            @triton.jit
            def target_lse_kernel(
                target_lse_ptr,  # [num_tokens]
                target_logits_ptr,  # [num_tokens, vocab_size]
                vocab_size,
                BLOCK_SIZE: tl.constexpr,
            ):
                row = tl.program_id(0)
                row_max = tl.full((), float("-inf"), tl.float32)
                for v in range(0, vocab_size, BLOCK_SIZE):
                    vocab_offset = v + tl.arange(0, BLOCK_SIZE)
                    logits = tl.load(
                        target_logits_ptr + row * vocab_size + vocab_offset,
                        mask=vocab_offset < vocab_size,
                        other=float("-inf"),
                    ).to(tl.float32)
                    row_max = tl.maximum(row_max, tl.max(logits, axis=0))
                total = tl.full((), 0.0, tl.float32)
                for v in range(0, vocab_size, BLOCK_SIZE):
                    vocab_offset = v + tl.arange(0, BLOCK_SIZE)
                    vocab_mask = vocab_offset < vocab_size
                    logits = tl.load(
                        target_logits_ptr + row * vocab_size + vocab_offset,
                        mask=vocab_mask,
                        other=float("-inf"),
                    ).to(tl.float32)
                    total += tl.sum(tl.where(vocab_mask, tl.exp(logits - row_max), 0.0), axis=0)
                tl.store(target_lse_ptr + row, row_max + tl.log(total))
            '''
        )
        why_kernel = "max, then sum(exp(x - max)) over 8192-lane tiles: reads the logits, writes one value per row"
        return insert_after(
            node,
            top_level(helper, "PN390", "the softmax normaliser of each row, instead of the softmax itself"),
            top_level(kernel, "PN390", why_kernel),
            blank_line=False,
        )


def _base(expr: cst.BaseExpression) -> cst.BaseExpression:
    """The pointer of ``ptr + a + b``: the leftmost operand of a chain of additions."""
    while isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
        expr = expr.left
    return expr


def _rebase(expr: cst.BinaryOperation, pointer: str) -> cst.BinaryOperation:
    if isinstance(expr.left, cst.BinaryOperation) and isinstance(expr.left.operator, cst.Add):
        return expr.with_changes(left=_rebase(expr.left, pointer))
    return expr.with_changes(left=cst.Name(pointer))


def _load_of(pointer: str) -> m.Call:
    offset = m.MatchIfTrue(lambda e: isinstance(e, cst.BinaryOperation) and m.matches(_base(e), m.Name(pointer)))
    return m.Call(func=m.Attribute(value=m.Name("tl"), attr=m.Name("load")), args=[m.Arg(offset), m.ZeroOrMore()])


def _reads_probs() -> m.SimpleStatementLine:
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=_load_of("target_probs_ptr"))])


def _rewrite_loads(fn: cst.FunctionDef, lse: str) -> cst.FunctionDef:
    """Each ``p = tl.load(target_probs_ptr + off[, mask=M, other=0.0])`` becomes the logit's load
    and ``p = exp(logit - lse)``, ``0.0`` where the load is masked (as the pristine load gives)."""
    loads = find(fn, _reads_probs())
    if not loads:
        raise ValueError(f"{fn.name.value} reads no target_probs_ptr")
    swaps = {}
    for stmt in loads:
        (assign,) = stmt.body
        load = assign.value
        rebased = load.with_changes(args=[load.args[0].with_changes(value=_rebase(load.args[0].value, "target_logits_ptr")), *load.args[1:]])
        logit = stmt.with_changes(body=[assign.with_changes(targets=[cst.AssignTarget(cst.Name("target_logit"))], value=rebased)])
        prob = f"tl.exp(target_logit.to(tl.float32) - {lse})"
        masks = [a.value for a in load.args if a.keyword is not None and a.keyword.value == "mask"]
        if masks:
            mask = cst.Module([]).code_for_node(masks[0])
            prob = f"tl.where({mask}, {prob}, 0.0)"
        (use,) = statements(f"{assign.targets[0].target.value} = {prob}")
        swaps[stmt] = [with_marker(logit, "PN390", "the logit; its softmax probability is exp(logit - lse)"), use]
    return fn.visit(_Splice(swaps))


class AcceptanceReadsLogits(Codemod):
    """The acceptance kernel's ``target_prob`` is ``exp(logit - lse)`` of the draft token."""

    target = TARGET
    anchor = (ACCEPT_KERNEL,)
    patched = (ACCEPT_KERNEL, _marked_assign("target_logit"))

    def rewrite(self, node):
        fn = _params(node, "target_probs_ptr", "target_logits_ptr", "target_lse_ptr")
        return _rewrite_loads(fn, "tl.load(target_lse_ptr + start_idx + pos)")


class RecoveryKernelReadsLogits(Codemod):
    """The recovered-token kernel loads its row's logsumexp once and forms each tile's probabilities."""

    target = TARGET
    anchor = (RECOVERY_KERNEL,)
    patched = (RECOVERY_KERNEL, _marked_assign("target_lse"))

    def rewrite(self, node):
        fn = _params(node, "target_probs_ptr", "target_logits_ptr", "target_lse_ptr")
        fn = _rewrite_loads(fn, "target_lse")
        (loop,) = [s for s in fn.body.body if m.matches(s, m.For())]
        (preload,) = statements("target_lse = tl.load(target_lse_ptr + token_idx)")
        preload = with_marker(preload.with_changes(leading_lines=loop.leading_lines), "PN390", "this row's logsumexp")
        return fn.visit(_Splice({loop: [preload, loop.with_changes(leading_lines=[])]}))


class PN390(Patch):
    id = "PN390"
    family = "sampling"
    title = "Rejection sampler: non-greedy verification without the full-vocabulary target_probs tensor"
    why = (
        "With a sampling request in a spec-decode step, the V1 rejection sampler materialises a "
        "num_draft_tokens x vocab fp32 softmax that its kernels read a few entries of. Compute one "
        "logsumexp per row and form p = exp(logit - lse) in the kernels instead (vllm#45369)."
    )
    upstream_refs = ("vllm#45369",)
    written_for = ">=0.20.1,<0.30.0"
    edits = (
        ComputeLogsumexp,
        CheckLogsumexp,
        PassLogitsToRecovery,
        PassLogitsToAcceptance,
        RecoveryTakesLogits,
        AddLogsumexpKernel,
        AcceptanceReadsLogits,
        RecoveryKernelReadsLogits,
    )

    def upstream_fix(self, module_of) -> str | None:
        """vLLM's own version (vllm#45369, unmerged so far): ``rejection_sample`` binds an unmarked
        per-row ``target_lse`` and builds no softmax of the target logits."""
        module = module_of(TARGET)
        if module is None:
            return None
        own = [n for n in reach(module, (SAMPLE, assign_to("target_lse")))
               if not m.matches(n, _marked_assign("target_lse"))]
        if own and not reach(module, (SAMPLE, SOFTMAX)):
            return f"{TARGET}: rejection_sample computes a per-row target_lse and no softmax (vllm#45369)"
        return None
