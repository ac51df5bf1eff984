"""P62 on real 0.20.1 and 0.24.0 source: the reasoning end inside a speculative batch starts the grammar.

Behaviour test by extraction (vLLM's scheduler and structured-output manager need torch and
the engine to import). What runs is real vLLM code, pristine and patched:
- ``StructuredOutputManager`` methods ``should_fill_bitmask``, ``grammar_bitmask``,
  ``_fill_bitmasks`` and ``should_advance`` (pristine) / ``_grammar_start``,
  ``accept_tokens``, ``validate_tokens`` (patched), taken from the file text;
- the scheduler statements the patch rewrites, taken from ``Scheduler.update_from_output``,
  ``update_draft_token_ids`` and ``update_draft_token_ids_in_output`` with the patch's own
  anchors (pristine) and ``patched`` matchers (patched), executed as they stand.
Stood in: the reasoning parser (``</think>`` semantics of vLLM's
``BaseThinkingReasoningParser``), the grammar (a fixed token sequence, with the
accept/validate/rollback/fill_bitmask interface of ``StructuredOutputGrammar``), the bitmask
tensor (records how each row was filled), the request, and the scheduler's token counters
(restated from 0.20.1's ``schedule``/``update_from_output``: a step schedules 1 + k tokens,
rejected drafts are subtracted, accepted tokens appended; unchanged in 0.24.0).

Every behaviour test runs on both releases P62 claims at their ends of its APPLIES range in
the release train: 0.20.1 (the pin) and 0.24.0 (the last release it applies to, where
``grammar_bitmask``'s draft loop iterates a hoisted ``token_iter``). The last test walks the
two upstream shapes that retire it (0.27.0 and 0.30.0) and the half-upstream drift between.
"""

from __future__ import annotations

import itertools
import logging
import textwrap
import types
from collections.abc import Iterable

import pytest
from packaging.version import Version

from kiln.patch.anchor import resolve
from kiln.patch.engine import Session
from kiln.source.wheel import WheelSource
from tests.patchsets.support.patchlib import extract, patched_files

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

# the releases the behaviour tests run on (both ends of P62's APPLIES range, see above)
RELEASES = ["0.20.1", "0.24.0"]
_SESSIONS: dict[str, Session] = {}


def release_session(version: str) -> Session:
    """The pristine tree of a vLLM release (its PyPI wheel, through the kiln cache)."""
    if version not in _SESSIONS:
        _SESSIONS[version] = Session(WheelSource(Version(version)).fetch())
    return _SESSIONS[version]

SO = "v1/structured_output/__init__.py"
SCHED = "v1/core/sched/scheduler.py"

THINK, END = 1, 2  # <think>, </think>
LBRACE, KEY, COLON, ONE, RBRACE = 20, 21, 22, 23, 24  # the answer the grammar allows
BAD = 99  # a token the grammar rejects
ANSWER = [LBRACE, KEY, COLON, ONE, RBRACE]
PROMPT = [5, 6, THINK]


class Reasoner:
    """``</think>`` reasoning parser, as vLLM's ``BaseThinkingReasoningParser`` decides it."""

    def is_reasoning_end(self, input_ids):
        for token in reversed(list(input_ids)):
            if token == THINK:
                return False
            if token == END:
                return True
        return False

    def is_reasoning_end_streaming(self, input_ids, delta_ids):
        return END in delta_ids


class Grammar:
    """Accepts exactly ``ANSWER``; records what advanced it."""

    def __init__(self):
        self.pos = 0
        self.accepted: list[int] = []

    def accept_tokens(self, request_id, tokens):
        for token in tokens:
            if self.pos >= len(ANSWER) or ANSWER[self.pos] != token:
                return False
            self.pos += 1
            self.accepted.append(token)
        return True

    def validate_tokens(self, tokens):
        valid = []
        for offset, token in enumerate(tokens):
            if self.pos + offset >= len(ANSWER) or ANSWER[self.pos + offset] != token:
                break
            valid.append(token)
        return valid

    def rollback(self, n):
        self.pos -= n
        del self.accepted[-n:]

    def is_terminated(self):
        return self.pos >= len(ANSWER)

    def fill_bitmask(self, bitmask, index):
        bitmask.rows[index] = ("grammar", self.pos)


class Bitmask:
    """Stands in for the int32 bitmask tensor: row ``i`` says how it was filled."""

    def __init__(self, n):
        self.rows = [None] * n
        self.shape = (n,)

    def __getitem__(self, key):
        if isinstance(key, slice):
            view = Bitmask(0)
            view.rows = self.rows[key]
            return view
        return types.SimpleNamespace(fill_=lambda _value: self.rows.__setitem__(key, "all"))

    def numpy(self):
        return self.rows


def _manager_cls(text: str, names: list[str]) -> type:
    namespace = {
        "itertools": itertools,
        "Iterable": Iterable,
        "TYPE_CHECKING": False,
        "StructuredOutputGrammar": Grammar,
        # 0.24.0's should_advance tells structural tags (advanced in the same step) from the rest
        "StructuredOutputOptions": types.SimpleNamespace(JSON="json", STRUCTURAL_TAG="structural_tag"),
    }
    for name in names:
        exec(
            compile(extract(text, f"StructuredOutputManager.{name}"), f"<{name}>", "exec"),
            namespace,
        )
    methods = {name: namespace[name] for name in names}
    methods["_get_reasoner"] = lambda self, request: self.reasoner
    return type("StructuredOutputManager", (), methods)


def _manager(cls, *, reasoner=None, num_spec=4):
    mgr = cls()
    mgr.reasoner = reasoner if reasoner is not None else Reasoner()
    mgr.enable_in_reasoning = False
    mgr.fill_bitmask_parallel_threshold = 128
    mgr._grammar_bitmask = None
    mgr._full_mask = -1
    mgr.backend = types.SimpleNamespace(allocate_token_bitmask=Bitmask)
    mgr.vllm_config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=num_spec),
        scheduler_config=types.SimpleNamespace(max_num_seqs=1),
        # 0.24.0 reads these two directly (spec decode and diffusion LLMs share the rows)
        num_speculative_tokens=num_spec,
        model_config=types.SimpleNamespace(is_diffusion=False),
    )
    return mgr


def _statement(text: str, anchor) -> str:
    """Source of the one statement ``anchor`` reaches in ``text``, dedented."""
    import libcst as cst

    module = cst.parse_module(text)
    node = resolve(module, anchor).unique
    assert node is not None, anchor
    return textwrap.dedent(module.code_for_node(node))


def _request(output=(10, 11)):
    all_token_ids = [*PROMPT, *output]
    return types.SimpleNamespace(
        request_id="r",
        use_structured_output=True,
        structured_output_request=types.SimpleNamespace(
            reasoning_ended=None, grammar=Grammar(), structured_output_key=("json", "{}")
        ),
        prompt_token_ids=list(PROMPT),
        all_token_ids=all_token_ids,
        # before a step: every token but the last sampled one has been computed
        num_computed_tokens=len(all_token_ids) - 1,
        num_output_placeholders=0,
    )


class Side:
    """One side (pristine or patched): the manager class and the scheduler statements."""

    def __init__(self, so_text, sched_text, names, accept_stmt, validate_stmts):
        self.manager_cls = _manager_cls(so_text, names)
        self.accept_src = _statement(sched_text, accept_stmt)
        self.validate_srcs = [_statement(sched_text, a) for a in validate_stmts]

    def update_from_output(self, mgr, request, drafts, accepted, bonus):
        """One spec-decode step, with 0.20.1's counters, then the (real) grammar statement."""
        request.num_computed_tokens += 1 + len(drafts)  # schedule(): last token + drafts
        num_rejected = len(drafts) - accepted
        request.num_computed_tokens -= num_rejected  # update_from_output()
        new_token_ids = [*drafts[:accepted], bonus]
        request.all_token_ids.extend(new_token_ids)  # _update_request_with_output()
        ns = {
            "self": types.SimpleNamespace(structured_output_manager=mgr),
            "request": request,
            "req_id": request.request_id,
            "new_token_ids": new_token_ids,
            "stopped": False,
            "logger": logging.getLogger("test_p62"),
            "RequestStatus": types.SimpleNamespace(FINISHED_ERROR="FINISHED_ERROR"),
        }
        exec(compile(self.accept_src, "<update_from_output>", "exec"), ns)
        return ns["stopped"]

    def validate_drafts(self, mgr, request, drafts):
        results = []
        for src in self.validate_srcs:
            ns = {
                "self": types.SimpleNamespace(structured_output_manager=mgr),
                "request": request,
                "spec_token_ids": list(drafts),
            }
            exec(compile(src, "<update_draft_token_ids>", "exec"), ns)
            results.append(ns["spec_token_ids"])
        return results


@pytest.fixture(scope="module")
def edits(catalogue):
    return {e.__name__: e for e in catalogue.get("P62").edits}


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param


@pytest.fixture(scope="module")
def patched(catalogue, release, edits):
    files = patched_files(catalogue, release_session(release), "P62")
    names = [
        "should_fill_bitmask",
        "_grammar_start",
        "accept_tokens",
        "validate_tokens",
        "grammar_bitmask",
        "_fill_bitmasks",
    ]
    return Side(
        files[SO],
        files[SCHED],
        names,
        edits["AcceptTokensPastReasoningEnd"].patched,
        [
            edits["ValidateDraftsPastReasoningEnd"].patched,
            edits["ValidateScheduledDraftsPastReasoningEnd"].patched,
        ],
    )


@pytest.fixture(scope="module")
def pristine(release, edits):
    tree = release_session(release).tree
    names = ["should_fill_bitmask", "should_advance", "grammar_bitmask", "_fill_bitmasks"]
    return Side(
        tree.read(SO),
        tree.read(SCHED),
        names,
        edits["AcceptTokensPastReasoningEnd"].anchor,
        [
            edits["ValidateDraftsPastReasoningEnd"].anchor,
            edits["ValidateScheduledDraftsPastReasoningEnd"].anchor,
        ],
    )


# --- update_from_output: the accepted batch holds </think> and the first answer tokens ---


def test_grammar_advances_from_the_token_after_the_reasoning_end(patched):
    mgr, request = _manager(patched.manager_cls), _request()
    grammar = request.structured_output_request.grammar
    # drafts [12, </think>, {] all accepted, bonus token KEY
    stopped = patched.update_from_output(mgr, request, [12, END, LBRACE], accepted=3, bonus=KEY)
    assert not stopped
    assert request.structured_output_request.reasoning_ended is True
    assert grammar.accepted == [LBRACE, KEY]  # starts right after </think>, same step
    patched.update_from_output(mgr, request, [COLON, ONE], accepted=2, bonus=RBRACE)
    assert grammar.accepted == ANSWER and grammar.is_terminated()


def test_pristine_misses_the_reasoning_end_and_bypasses_the_grammar(pristine):
    mgr, request = _manager(pristine.manager_cls), _request()
    grammar = request.structured_output_request.grammar
    pristine.update_from_output(mgr, request, [12, END, LBRACE], accepted=3, bonus=KEY)
    pristine.update_from_output(mgr, request, [COLON, ONE], accepted=2, bonus=RBRACE)
    # should_advance only looked at the last token of each step: </think> never seen
    assert not request.structured_output_request.reasoning_ended
    assert grammar.accepted == []


def test_reasoning_end_as_the_bonus_token_starts_the_grammar_next_step(patched):
    mgr, request = _manager(patched.manager_cls), _request()
    grammar = request.structured_output_request.grammar
    patched.update_from_output(mgr, request, [12, 13], accepted=2, bonus=END)
    assert request.structured_output_request.reasoning_ended is True and grammar.accepted == []
    patched.update_from_output(mgr, request, [LBRACE, KEY], accepted=1, bonus=KEY)
    assert grammar.accepted == [LBRACE, KEY]


def test_rejected_answer_token_still_terminates_the_request(patched):
    mgr, request = _manager(patched.manager_cls), _request()
    assert patched.update_from_output(mgr, request, [12, END, BAD], accepted=3, bonus=KEY) is True


@pytest.mark.parametrize("steps", [[12, END, LBRACE, KEY, COLON], [END, LBRACE, KEY]])
def test_single_token_decode_matches_pristine(patched, pristine, steps):
    """Without drafts the patched path does what 0.20.1 did: the grammar starts next token."""
    seen = []
    for side in (pristine, patched):
        mgr, request = _manager(side.manager_cls), _request()
        trace = []
        for token in steps:
            side.update_from_output(mgr, request, [], accepted=0, bonus=token)
            trace.append(
                (
                    bool(request.structured_output_request.reasoning_ended),
                    list(request.structured_output_request.grammar.accepted),
                )
            )
        seen.append(trace)
    assert seen[0] == seen[1]


def test_without_reasoning_parser_every_token_goes_to_the_grammar(patched):
    mgr = _manager(patched.manager_cls)
    mgr.reasoner = None
    request = _request(output=())
    patched.update_from_output(mgr, request, [LBRACE, KEY], accepted=2, bonus=COLON)
    assert request.structured_output_request.grammar.accepted == [LBRACE, KEY, COLON]


# --- grammar_bitmask: the draft window crosses the reasoning end ---


def _bitmask(side, drafts):
    mgr, request = _manager(side.manager_cls), _request()
    rows = mgr.grammar_bitmask({"r": request}, ["r"], {"r": list(drafts)})
    return rows, request.structured_output_request.grammar


def test_bitmask_rows_after_the_reasoning_end_are_constrained(patched):
    rows, grammar = _bitmask(patched, [12, END, LBRACE, KEY])
    # rows 0, 1: still reasoning; row 2 (the token after </think>) on: the grammar's mask,
    # advanced by each draft in between
    assert rows == ["all", "all", ("grammar", 0), ("grammar", 1), ("grammar", 2)]
    assert grammar.pos == 0 and grammar.accepted == []  # rolled back afterwards


def test_pristine_bitmask_leaves_the_answer_unconstrained(pristine):
    rows, _ = _bitmask(pristine, [12, END, LBRACE, KEY])
    assert rows == ["all"] * 5


def test_bitmask_with_padding_and_end_as_last_draft(patched):
    rows, _ = _bitmask(patched, [12, END, LBRACE, -1])
    assert rows == ["all", "all", ("grammar", 0), ("grammar", 1), "all"]
    rows, _ = _bitmask(patched, [12, 13, 14, END])
    assert rows == ["all"] * 4 + [("grammar", 0)]  # only the bonus row


def test_bitmask_unchanged_while_reasoning_or_after_it(patched, pristine):
    assert _bitmask(patched, [12, 13])[0] == _bitmask(pristine, [12, 13])[0] == ["all"] * 3
    for side in (patched, pristine):
        mgr, request = _manager(side.manager_cls), _request()
        request.structured_output_request.reasoning_ended = True
        rows = mgr.grammar_bitmask({"r": request}, ["r"], {"r": [LBRACE, KEY]})
        assert rows == [("grammar", 0), ("grammar", 1), ("grammar", 2)]


# --- update_draft_token_ids(_in_output): drafts after the reasoning end are validated ---


def test_drafts_after_the_reasoning_end_are_grammar_checked(patched, pristine):
    drafts = [12, END, LBRACE, BAD]
    mgr, request = _manager(patched.manager_cls), _request()
    assert patched.validate_drafts(mgr, request, drafts) == [[12, END, LBRACE]] * 2
    mgr, request = _manager(pristine.manager_cls), _request()
    assert pristine.validate_drafts(mgr, request, drafts) == [drafts] * 2  # BAD kept


def test_drafts_while_reasoning_pass_unchecked(patched):
    mgr, request = _manager(patched.manager_cls), _request()
    assert patched.validate_drafts(mgr, request, [12, BAD]) == [[12, BAD]] * 2
    request.structured_output_request.reasoning_ended = True
    assert patched.validate_drafts(mgr, request, [LBRACE, BAD]) == [[LBRACE]] * 2


# --- verdicts ---


@pytest.mark.parametrize("version", RELEASES)
def test_applies_once(catalogue, version):
    from kiln.patch.engine import isolated_run
    from kiln.patch.model import BuildTarget, Verdict

    session = release_session(version)
    target = BuildTarget(session.tree.vllm_version)
    first = isolated_run(catalogue, session, target, "P62")
    assert first.outcomes["P62"].verdict is Verdict.APPLIES
    again = isolated_run(catalogue, session.overlay(first.state.changed), target, "P62")
    assert again.outcomes["P62"].verdict is Verdict.ALREADY_PATCHED
    assert "should_advance(" not in first.changed_text()[SCHED]


def test_upstream_on_0330_detected_by_shape(catalogue, sessions, edits):
    import libcst as cst

    from kiln.patch.engine import isolated_run
    from kiln.patch.model import BuildTarget, Verdict

    session = sessions("v0.33.0")
    outcome = isolated_run(
        catalogue, session, BuildTarget(session.tree.vllm_version), "P62"
    ).outcomes["P62"]
    assert outcome.verdict is Verdict.UPSTREAM, outcome.detail
    assert "_get_constraint_bounds" in outcome.detail
    # the 0.20.1 anchors are gone there: without the shape check this would read as drift
    for name in ("AddReasoningAwareMethods", "AcceptTokensPastReasoningEnd"):
        edit = edits[name]
        module = cst.parse_module(session.tree.read(edit.target))
        assert resolve(module, edit.anchor).unique is None


@pytest.mark.parametrize(
    ("version", "verdict", "says"),
    [
        # the bitmask half is upstream, the accepted-token window is not: the patch does not fit
        ("0.25.0", "DRIFTED", "AcceptTokensPastReasoningEnd: v1/core/sched/scheduler.py:"),
        ("0.27.0", "UPSTREAM", "should_advance reads the reasoning end from the tokens accepted this step"),
        ("0.30.0", "UPSTREAM", "StructuredOutputManager._get_constraint_start finds where the grammar starts"),
    ],
)
def test_verdicts_where_upstream_took_it_over(catalogue, version, verdict, says):
    from kiln.patch.engine import isolated_run
    from kiln.patch.model import BuildTarget

    session = release_session(version)
    outcome = isolated_run(catalogue, session, BuildTarget(Version(version)), "P62").outcomes["P62"]
    assert (str(outcome.verdict), says in outcome.detail) == (verdict, True), outcome.detail
