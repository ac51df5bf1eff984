"""P62: structured output under spec decode sees the reasoning end inside a speculative batch.

What fails on 0.20.1: with a reasoning parser, the grammar only applies once reasoning has
ended, and ``StructuredOutputManager.should_advance`` is what notices the end. It looks for
the end token in ``all_token_ids[num_computed_tokens - num_output_placeholders:]``. After a
spec-decode step that window is only the last accepted token: ``num_computed_tokens`` already
counts the accepted drafts, so a ``</think>`` accepted as a draft (any position but the last)
is never seen, ``reasoning_ended`` stays False for the rest of the request and the grammar is
bypassed for the whole answer (vllm#34650, #31858). Even when the end is seen, the answer
tokens accepted in the same step never reach the grammar, the bitmask rows after the end
inside the draft window stay unconstrained, and draft validation is all-or-nothing.

What the patch does (the approach of vllm#36138, written for 0.20.1): the manager learns
where, inside a batch of tokens, the grammar starts (``_grammar_start``: 0 when it already
applies, the position right after the reasoning end when the end falls inside the batch,
None while reasoning goes on), and uses it in three places:
- ``accept_tokens`` (scheduler ``update_from_output``): the accepted tokens after the end
  advance the grammar in the same step, and ``reasoning_ended`` is latched from the tokens
  really accepted, not from a counter-derived window;
- ``validate_tokens`` (scheduler ``update_draft_token_ids`` and ``_in_output``): drafts up
  to the end pass unchecked, the rest are cut at the first one the grammar rejects;
- ``grammar_bitmask``: rows after the end inside the draft window get the grammar's mask
  and advance it (rolled back afterwards, as before).
A token that ends reasoning implicitly (Qwen3's ``<tool_call>``) is treated like
``</think>``: the grammar starts after it, as 0.20.1 already does without spec decode.
``should_advance`` stays (unused) so that out-of-tree callers keep working. Whether a
request reasons is decided at runtime per request, as before; nothing is model-specific.

On 0.33.0: UPSTREAM, in a different shape. ``StructuredOutputManager`` has
``_get_constraint_bounds`` (the same "where does the grammar start in this batch" index,
``v1/structured_output/__init__.py``), which ``accept_tokens`` and ``grammar_bitmask`` use,
and the scheduler calls ``structured_output_manager.accept_tokens`` in ``update_from_output``
and ``validate_tokens`` for drafts (``v1/core/sched/scheduler.py``); ``should_advance`` is
gone (vllm#44297, #44993, #48200; #36138 itself was never merged). ``upstream_fix`` detects
that shape, so the pin bump reports a retired patch instead of the anchor drift a text
search for ``should_advance`` would report.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.24.0: APPLIES. 0.24.0 hoists the draft loop's iterable of ``grammar_bitmask`` into
  ``token_iter`` (diffusion LLMs take no bonus row); ``ConstrainRowsAfterReasoningEnd``'s
  anchor takes both shapes (before this review it read DRIFTED there), and the behaviour
  tests run on 0.24.0 as well as 0.20.1.
- 0.25.0-0.26.0: DRIFTED, half upstream. ``grammar_bitmask`` finds a reasoning end inside the
  draft window and constrains the rows after it (its loop, the anchor, is rewritten), and
  ``update_from_output`` trims reasoning tokens before the grammar
  (``trim_reasoning_for_advance``). But ``should_advance`` still reads the end from the
  counter-derived window (the last accepted token) and advances in the same step only for
  structural tags: the failure stays. ``AcceptTokensPastReasoningEnd``'s structure check
  raises there ("the grammar-rejection branch is not where expected",
  ``scheduler.py:1638`` on 0.25.0), reported as this patch's drift.
- 0.27.0-0.29.0: UPSTREAM, shape A. ``should_advance(request, new_token_ids)`` reads the end
  from the tokens accepted this step (the fix of vllm#43388;
  ``structured_output/__init__.py:381`` on 0.27.0), ``update_from_output`` calls it so and
  hands the tokens after the end to the grammar in the same step, and ``grammar_bitmask``
  constrains the rows after an end inside the window.
- 0.30.0 on: UPSTREAM, shape B. ``StructuredOutputManager._get_constraint_start`` (renamed
  ``_get_constraint_bounds`` in 0.32.0) drives ``accept_tokens``, ``validate_tokens`` and
  ``grammar_bitmask``, which the scheduler calls; ``should_advance`` is gone. ``upstream_fix``
  finds the helper by its role (called by all three, looks for the reasoning end), not by
  name, and ignores kiln's own marked methods (a re-run stays ALREADY_PATCHED).
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import count, find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    cls,
    func,
    insert_after,
    kiln_marked,
    marked,
    place_of,
    statements,
    with_marker,
)

STRUCTURED_OUTPUT = "v1/structured_output/__init__.py"
SCHEDULER_FILE = "v1/core/sched/scheduler.py"
MANAGER = cls("StructuredOutputManager")
SCHEDULER = cls("Scheduler")


def _self_call(*attrs: str) -> m.Call:
    """A call ``self.a.b(...)`` (attribute chain on ``self``)."""
    target: m.BaseExpression = m.Name("self")
    for attr in attrs:
        target = m.Attribute(value=target, attr=m.Name(attr))
    return m.Call(func=target)


SHOULD_ADVANCE_CALL = m.Call(
    func=m.Attribute(
        value=m.Attribute(attr=m.Name("structured_output_manager")), attr=m.Name("should_advance")
    )
)


def _assigns(name: str, **kwargs) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(
        body=[m.Assign(targets=[m.AssignTarget(target=m.Name(name))])], **kwargs
    )


def _methods(source: str) -> list[cst.FunctionDef]:
    """Parse methods written at class-body indentation (docstrings keep their layout)."""
    (holder,) = statements("class _:\n" + source)
    return [method.with_changes(leading_lines=[]) for method in holder.body.body]


METHODS = '''
    def _grammar_start(
        self, request: "Request", token_ids: Iterable[int], committed: bool
    ) -> int | None:
        """Index into `token_ids` from which the grammar constrains them.

        0 when the grammar already applies, the index right after the token that
        ends reasoning when it falls within `token_ids`, None while reasoning goes
        on past them. `committed`: the tokens are the tail of
        `request.all_token_ids` (accepted output), else drafts that follow it.
        Trailing -1 padding is ignored.
        """
        if self.should_fill_bitmask(request):
            return 0
        reasoner = self._get_reasoner(request)
        assert reasoner is not None
        tokens = list(itertools.takewhile(lambda t: t != -1, token_ids))
        all_token_ids = request.all_token_ids
        base = len(all_token_ids) - len(tokens) if committed else len(all_token_ids)

        def ends_within(n: int) -> bool:
            if committed and n == len(tokens):
                output = all_token_ids
            elif committed:
                output = all_token_ids[: base + n]
            else:
                output = [*all_token_ids, *tokens[:n]]
            return reasoner.is_reasoning_end_streaming(output, tokens[:n])

        if not tokens or not ends_within(len(tokens)):
            return None
        # The first token that ends reasoning; the grammar starts after it.
        return next(n for n in range(1, len(tokens) + 1) if ends_within(n))

    def accept_tokens(self, request: "Request", new_token_ids: list[int]) -> bool:
        """Advance the grammar with the tokens accepted this step.

        The tokens are already appended to the request. Under spec decode they can
        hold the reasoning end followed by answer tokens: those go to the grammar
        in this same step. False when the grammar rejects them.
        """
        if not request.use_structured_output or not new_token_ids:
            return True
        start = self._grammar_start(request, new_token_ids, committed=True)
        if start is None:
            return True
        structured_req = request.structured_output_request
        assert structured_req is not None and structured_req.grammar is not None
        if start > 0:
            structured_req.reasoning_ended = True
        if start >= len(new_token_ids):
            return True
        return structured_req.grammar.accept_tokens(
            request.request_id, new_token_ids[start:]
        )

    def validate_tokens(
        self, request: "Request", spec_token_ids: list[int]
    ) -> list[int]:
        """The drafts to keep: those up to the reasoning end pass unchecked, the
        rest are cut at the first one the grammar rejects."""
        if not request.use_structured_output:
            return spec_token_ids
        start = self._grammar_start(request, spec_token_ids, committed=False)
        if start is None or start >= len(spec_token_ids):
            return spec_token_ids
        grammar = request.structured_output_request.grammar
        assert grammar is not None
        return spec_token_ids[:start] + grammar.validate_tokens(
            spec_token_ids[start:]
        )
'''
METHOD_WHY = {
    "_grammar_start": "find the reasoning end inside a spec-decode batch (vllm#36138)",
    "accept_tokens": "the grammar takes the accepted tokens after the reasoning end",
    "validate_tokens": "drafts after the reasoning end are grammar-checked",
}


class AddReasoningAwareMethods(Codemod):
    """Add ``_grammar_start``, ``accept_tokens`` and ``validate_tokens`` after ``should_advance``."""

    target = STRUCTURED_OUTPUT
    anchor = (MANAGER, func("should_advance"))
    patched = (MANAGER, func("_grammar_start", leading_lines=marked("P62")))

    def rewrite(self, node):
        methods = [with_marker(f, "P62", METHOD_WHY[f.name.value]) for f in _methods(METHODS)]
        return insert_after(node, *methods)


class ConstrainRowsAfterReasoningEnd(Codemod):
    """In ``grammar_bitmask``'s draft loop, constrain (and advance) from the reasoning end on."""

    target = STRUCTURED_OUTPUT
    # ``for token in itertools.chain(req_tokens, (-1,))`` (0.20.1-0.23.0); 0.24.0 hoists the
    # iterable into ``token_iter`` (diffusion LLMs take no bonus row), the loop is the same.
    anchor = (
        MANAGER,
        func("grammar_bitmask"),
        m.For(
            target=m.Name("token"),
            iter=m.OneOf(
                m.Call(func=m.Attribute(value=m.Name("itertools"), attr=m.Name("chain"))),
                m.Name("token_iter"),
            ),
        ),
    )
    patched = (
        MANAGER,
        func("grammar_bitmask"),
        _assigns("grammar_start", leading_lines=marked("P62")),
    )

    def rewrite(self, node):
        (start,) = statements(
            """
            grammar_start = self._grammar_start(
                request, req_tokens, committed=False
            )
            """
        )
        (switch_on,) = statements(
            """
            if i == grammar_start:
                # Reasoning ended at the previous draft: constrain from this row on.
                apply_bitmask = True
            """
        )
        (header,) = statements("for i, token in enumerate(_):\n    pass")
        loop = node.with_changes(
            target=header.target,
            iter=header.iter.with_changes(args=[cst.Arg(node.iter)]),
            body=node.body.with_changes(body=[switch_on, *node.body.body]),
        )
        why = "constrain the rows after a reasoning end in the drafts"
        return cst.FlattenSentinel([with_marker(start, "P62", why), loop])


class AcceptTokensPastReasoningEnd(Codemod):
    """``update_from_output``: hand the accepted tokens to ``accept_tokens``, keep the error path."""

    target = SCHEDULER_FILE
    anchor = (
        SCHEDULER,
        func("update_from_output"),
        m.If(
            test=m.BooleanOperation(
                left=m.Name("new_token_ids"), operator=m.And(), right=SHOULD_ADVANCE_CALL
            )
        ),
    )
    patched = (SCHEDULER, func("update_from_output"), m.If(leading_lines=marked("P62")))

    def rewrite(self, node):
        rejected = [
            s
            for s in node.body.body
            if m.matches(
                s,
                m.If(
                    test=m.UnaryOperation(
                        operator=m.Not(),
                        expression=m.Call(func=m.Attribute(attr=m.Name("accept_tokens"))),
                    )
                ),
            )
        ]
        if len(rejected) != 1:
            raise ValueError("the grammar-rejection branch is not where expected")
        (new,) = statements(
            """
            if new_token_ids and not self.structured_output_manager.accept_tokens(
                request, new_token_ids
            ):
                pass
            """
        )
        new = new.with_changes(body=rejected[0].body, leading_lines=node.leading_lines)
        return with_marker(
            new, "P62", "the grammar takes the tokens after a reasoning end in this step"
        )


class ValidateDraftsPastReasoningEnd(Codemod):
    """``update_draft_token_ids``: validate drafts with the reasoning-aware ``validate_tokens``."""

    target = SCHEDULER_FILE
    method = "update_draft_token_ids"
    anchor = (SCHEDULER, func(method), m.If(test=SHOULD_ADVANCE_CALL))
    patched = (
        SCHEDULER,
        func(method),
        m.SimpleStatementLine(
            leading_lines=marked("P62"),
            body=[m.Assign(value=_self_call("structured_output_manager", "validate_tokens"))],
        ),
    )

    def rewrite(self, node):
        (new,) = statements(
            """
            spec_token_ids = self.structured_output_manager.validate_tokens(
                request, spec_token_ids
            )
            """
        )
        new = new.with_changes(leading_lines=node.leading_lines)
        return with_marker(new, "P62", "drafts after a reasoning end are grammar-checked")


class ValidateScheduledDraftsPastReasoningEnd(ValidateDraftsPastReasoningEnd):
    """The same change in ``update_draft_token_ids_in_output`` (async scheduling)."""

    method = "update_draft_token_ids_in_output"
    anchor = (SCHEDULER, func(method), m.If(test=SHOULD_ADVANCE_CALL))
    patched = (
        SCHEDULER,
        func(method),
        m.SimpleStatementLine(
            leading_lines=marked("P62"),
            body=[m.Assign(value=_self_call("structured_output_manager", "validate_tokens"))],
        ),
    )


# -- upstream detection -------------------------------------------------------------------------
# vLLM fixed this in two shapes (see "Verdicts across releases" above).

REASONING_END_CHECK = m.Call(
    func=m.Attribute(attr=m.OneOf(m.Name("is_reasoning_end_streaming"), m.Name("find_reasoning_end"), m.Name("find_reasoning_end_offset")))
)


def _manager_method(module: cst.Module, name: str) -> cst.FunctionDef | None:
    found = [fn for klass in find(module, MANAGER) for fn in find(klass, func(name))]
    return found[0] if len(found) == 1 and not kiln_marked(found[0]) else None


def _bounds_helper(manager: cst.Module) -> str | None:
    """Shape B (0.30.0 on): one manager method that says where the grammar starts in a batch
    of tokens (``_get_constraint_start``, renamed ``_get_constraint_bounds`` in 0.32.0), found
    by its role: it looks for the reasoning end, and ``accept_tokens``, ``validate_tokens`` and
    ``grammar_bitmask`` all call it."""
    callers = [_manager_method(manager, n) for n in ("accept_tokens", "validate_tokens", "grammar_bitmask")]
    if any(c is None for c in callers):
        return None
    for klass in find(manager, MANAGER):
        for helper in find(klass, m.FunctionDef()):
            name = helper.name.value
            if name in ("accept_tokens", "validate_tokens", "grammar_bitmask") or kiln_marked(helper):
                continue
            if not m.findall(helper, REASONING_END_CHECK):
                continue
            if all(m.findall(c, _self_call(name)) for c in callers):
                return name
    return None


def _constraint_helper_shape(module_of) -> str | None:
    manager, scheduler = module_of(STRUCTURED_OUTPUT), module_of(SCHEDULER_FILE)
    if manager is None or scheduler is None:
        return None
    helper = _bounds_helper(manager)
    if helper is None or count(scheduler, (SCHEDULER, SHOULD_ADVANCE_CALL)):
        return None
    helper_at = place_of(STRUCTURED_OUTPUT, manager, (MANAGER, func(helper)))
    accept_at = place_of(
        SCHEDULER_FILE, scheduler, (SCHEDULER, func("update_from_output"), _self_call("structured_output_manager", "accept_tokens"))
    )
    validate_at = place_of(
        SCHEDULER_FILE, scheduler, (SCHEDULER, func("update_draft_token_ids"), _self_call("structured_output_manager", "validate_tokens"))
    )
    if not (accept_at and validate_at):
        return None
    return (
        f"{helper_at}: StructuredOutputManager.{helper} finds where the grammar starts inside a "
        "batch and drives accept_tokens, validate_tokens and grammar_bitmask; "
        f"{accept_at}: the scheduler advances the grammar with structured_output_manager.accept_tokens "
        f"and {validate_at}: checks drafts with validate_tokens (should_advance is gone)"
    )


SHOULD_ADVANCE_WITH_TOKENS = m.Call(
    func=m.Attribute(value=m.Attribute(attr=m.Name("structured_output_manager")), attr=m.Name("should_advance")),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("new_token_ids")), m.ZeroOrMore()],
)
TRIM_REASONING = _self_call("structured_output_manager", "trim_reasoning_for_advance")


def _accepted_window_shape(module_of) -> str | None:
    """Shape A (0.29.0): ``should_advance(request, new_token_ids=...)`` reads the reasoning end
    from the tokens accepted this step (not from the counters), the scheduler trims the
    reasoning tokens and advances the grammar with the rest in the same step, and
    ``grammar_bitmask`` constrains the draft rows after a reasoning end inside the window."""
    manager, scheduler = module_of(STRUCTURED_OUTPUT), module_of(SCHEDULER_FILE)
    if manager is None or scheduler is None:
        return None
    advance = _manager_method(manager, "should_advance")
    bitmask = _manager_method(manager, "grammar_bitmask")
    if advance is None or bitmask is None or not m.findall(bitmask, REASONING_END_CHECK):
        return None
    if not any(p.name.value == "new_token_ids" for p in advance.params.params):
        return None
    if m.findall(advance, m.Attribute(attr=m.Name("STRUCTURAL_TAG"))):
        return None  # 0.25.0-0.26.0: the same-step advance only for structural tags
    update = (SCHEDULER, func("update_from_output"))
    window_at = place_of(SCHEDULER_FILE, scheduler, (*update, SHOULD_ADVANCE_WITH_TOKENS))
    trim_at = place_of(SCHEDULER_FILE, scheduler, (*update, TRIM_REASONING))
    if not (window_at and trim_at):
        return None
    advance_at = place_of(STRUCTURED_OUTPUT, manager, (MANAGER, func("should_advance")))
    bitmask_at = place_of(STRUCTURED_OUTPUT, manager, (MANAGER, func("grammar_bitmask")))
    return (
        f"{advance_at}: StructuredOutputManager.should_advance reads the reasoning end from the "
        f"tokens accepted this step (vllm#43388), called so at {window_at}; {trim_at}: the "
        "grammar takes the accepted tokens after the end in the same step; "
        f"{bitmask_at}: grammar_bitmask constrains the draft rows after a reasoning end"
    )


class P62(Patch):
    id = "P62"
    family = "spec_decode"
    title = "Structured output under spec decode: reasoning end inside a speculative batch"
    why = (
        "With a reasoning parser and spec decode, a </think> accepted as a draft is missed by "
        "should_advance (its window counts the accepted drafts), so the grammar is bypassed for "
        "the whole answer. Find the reasoning end inside each batch and constrain from there."
    )
    upstream_refs = (
        "vllm#36138",
        "vllm#34650",
        "vllm#31858",
        "vllm#44297",
        "vllm#44993",
        "vllm#48200",
    )
    written_for = ">=0.20.1"
    edits = (
        AddReasoningAwareMethods,
        ConstrainRowsAfterReasoningEnd,
        AcceptTokensPastReasoningEnd,
        ValidateDraftsPastReasoningEnd,
        ValidateScheduledDraftsPastReasoningEnd,
    )

    def upstream_fix(self, module_of) -> str | None:
        found = _constraint_helper_shape(module_of) or _accepted_window_shape(module_of)
        return f"fixed upstream in another shape: {found}" if found else None
