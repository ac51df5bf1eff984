"""K1: the qwen3 parser engine commits to a tool call only once ``<function=`` follows ``<tool_call>``.

Genesis has no such fix, so the id is from kiln's own sequence (``K<n>``, a prefix Genesis
never uses); it was P61d until the ids were aligned, and records written then still read
(``kiln.patch.catalog.RENAMED``).

P61c for the parser engine. From 0.24.0 ``qwen3_coder`` (and the ``qwen3`` reasoning parser)
are adapters of one streaming engine (``parser/engine/``, configured by ``qwen3_config`` in
``parser/qwen3.py``), and P61c's file is gone. The failure it fixed survived the rewrite, and
widened. ``<tool_call>`` moves the engine from content (or reasoning) to the ``TOOL_PREAMBLE``
state and emits ``TOOL_CALL_START``; text in that state has no content event
(``ParserEngineConfig.content_events`` names none for it, so ``_emit_for_state`` returns
nothing) and is dropped until a ``<function=`` header or ``</tool_call>``. A tag the model
writes without a header after it (mentioned in prose, emitted mid-thought, or followed by a
Hermes-style JSON body ``<tool_call>{"name": ...}``) silences the stream and loses the text
after it, up to the next real call or the end: in the streaming result and, the engine being
the same, in the non-streaming one too (on 0.20.1 only streaming lost it). Run on 0.24.0, 0.32.0 and
0.33.0 through the real adapter (``tests/patchsets/tool_parsing/test_k1.py``): "Use the
<tool_call> tag. Done." comes back as "Use the ".

What the patch does, for configs that ask for it (``qwen3_config`` does; no other model's
engine changes): a transition into ``TOOL_PREAMBLE`` that starts a call holds the call's start
event, and the text after the tag is held with it (the engine's lexer never hands out part of
a terminal, so a partial ``<function=`` never arrives as text before the end). Then:

- ``<function=`` commits the call, ``</tool_call>`` closes an unpromoted block: both exactly
  as before (the block and its text are dropped, vLLM's rule; its test for vllm#47137);
- a terminal that has no transition in ``TOOL_PREAMBLE`` but one in content (a second
  ``<tool_call>``) after non-blank held text releases the first tag as prose;
- at the end of the stream, held text that is neither blank nor the start of a header
  releases the tag; a truncated opener (``<tool_call>``, then whitespace, ``<`` or
  ``<function``: generation cut off by ``max_tokens`` or a stop string) sends nothing.

Releasing makes the tag and the held text one content chunk, back in the content state, and
takes the call back: its index, and its start event, which becomes an empty text chunk, so when
the tag came in the same delta (always, for non-streaming) the adapter sees no call at all and
keeps the content in order; an event already returned with an earlier delta opened a call that
stays empty and is skipped.

Why it holds rather than releasing at the first non-header text (as it first did): vLLM's own
regression tests for vllm#47137 (``tests/parser/engine/test_parser_engine.py``,
``TestTruncatedToolOpenerStreamParity``, 0.32.0 on) pass on the pristine source and failed on
the first K1: a truncated ``<tool_call>\n<function`` and an unpromoted
``<tool_call>garbage</tool_call>`` came back as content where vLLM sends nothing
(``ci/upstream_tests``, docs/UPSTREAM_TESTS.md). Prose after a tag now arrives at the end of the
stream (or at the next ``<tool_call>``) instead of as it is generated; a Hermes-style body
closed by ``</tool_call>`` is dropped as vLLM drops it.

Upstream: none (club-3090#72's case, Genesis P61c; the engine has no such rule on 0.33.0).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.23.0: GATED (``vllm>=0.24.0``): the engine does not exist; P61c covers these.
- 0.24.0 on: APPLIES. 0.24.0 serves ``qwen3_coder`` by ``Qwen3EngineToolParser``
  (``tool_parsers/qwen3_engine_tool_parser.py``, an adapter of ``Qwen3Parser``; vllm#45413 as
  recorded for P64). ``(CONTENT, TOOL_START) -> TOOL_PREAMBLE`` (``parser/qwen3.py:123`` on
  0.24.0, ``:205`` on 0.33.0) and the missing content event for ``TOOL_PREAMBLE``
  (``_emit_for_state``, ``parser/engine/streaming_parser_engine.py:279`` on 0.24.0, ``:483`` on
  0.33.0) are unchanged through 0.33.0; every codemod's anchor is found on every release.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, Patch
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

CONFIG_FILE = "parser/engine/parser_engine_config.py"
QWEN3_FILE = "parser/qwen3.py"
ENGINE_FILE = "parser/engine/streaming_parser_engine.py"
ENGINE = cls("StreamingParserEngine")
FLAG = "release_unheaded_tool_calls"


def _assigns_self(attr: str, **kwargs) -> m.SimpleStatementLine:
    """``self.<attr> = ...`` (annotated or not)."""
    target = m.Attribute(value=m.Name("self"), attr=m.Name(attr))
    return m.SimpleStatementLine(
        body=[m.OneOf(m.Assign(targets=[m.AssignTarget(target=target)]), m.AnnAssign(target=target))], **kwargs
    )


class AddReleaseFlag(Codemod):
    """``ParserEngineConfig`` gains the switch, off by default (other models' engines unchanged)."""

    target = CONFIG_FILE
    anchor = (cls("ParserEngineConfig"), assign_to("initial_state"))
    patched = (cls("ParserEngineConfig"),
               m.SimpleStatementLine(body=[m.AnnAssign(target=m.Name(FLAG))], leading_lines=marked("K1")))

    def rewrite(self, node):
        (flag,) = statements(f"{FLAG}: bool = False")
        why = "a <tool_call> with no <function= header after it is released as content"
        return insert_after(node, with_marker(flag, "K1", why))


def _returns_config(**kwargs) -> m.SimpleStatementLine:
    """``return ParserEngineConfig(...)``."""
    return m.SimpleStatementLine(body=[m.Return(value=m.Call(func=m.Name("ParserEngineConfig")))], **kwargs)


class Qwen3ConfigReleasesUnheadedCalls(Codemod):
    """``qwen3_config`` (qwen3, qwen3_coder and the parsers sharing its grammar) turns it on."""

    target = QWEN3_FILE
    anchor = (func("qwen3_config"), _returns_config())
    patched = (func("qwen3_config"), _returns_config(leading_lines=marked("K1")))

    def rewrite(self, node):
        call = node.body[0].value
        *before, last = call.args
        # the new keyword goes last: it takes the last argument's comma (what leads to the
        # closing parenthesis), the last argument takes the one between arguments
        tight = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
        flag = before[-1].with_changes(keyword=cst.Name(FLAG), value=cst.Name("True"), equal=tight, comma=last.comma)
        new_call = call.with_changes(args=[*before, last.with_changes(comma=before[-1].comma), flag])
        why = "a <tool_call> commits to a call only once its <function= header follows"
        return with_marker(node.with_changes(body=[node.body[0].with_changes(value=new_call)]), "K1", why)


class HeldToolStartState(Codemod):
    """Per-stream state: the held tag's start event, and the text held after it."""

    target = ENGINE_FILE
    anchor = (ENGINE, func("reset"), _assigns_self("tool_index"))
    patched = (ENGINE, func("reset"), _assigns_self("_held_tool_start", leading_lines=marked("K1")))

    def rewrite(self, node):
        held, preamble = statements(
            """
            self._held_tool_start: SemanticEvent | None = None  # a <tool_call>'s start event
            self._held_preamble = ""  # the text after it, held with it
            """
        )
        return insert_after(node, with_marker(held, "K1", "per stream: a held <tool_call>"), preamble,
                            blank_line=False)


EVENTS_LOOP = m.For(iter=m.Attribute(value=m.Name("transition"), attr=m.Name("events")))


class HoldOnEnteringPreamble(Codemod):
    """A transition into ``TOOL_PREAMBLE`` that starts a call holds its start event."""

    target = ENGINE_FILE
    anchor = (ENGINE, func("_apply_transition"), EVENTS_LOOP)
    patched = (ENGINE, func("_apply_transition"), _assigns_self("_held_tool_start", leading_lines=marked("K1")))

    def rewrite(self, node):
        held, preamble = statements(
            """
            self._held_tool_start = (
                events[-1]
                if self.state == ParserState.TOOL_PREAMBLE
                and self.config.release_unheaded_tool_calls
                and events
                and events[-1].type == EventType.TOOL_CALL_START
                else None
            )
            self._held_preamble = ""
            """
        )
        why = "a <tool_call> is held until <function=, </tool_call>, another opener or the end decides"
        return insert_after(node, with_marker(held, "K1", why), preamble, blank_line=False)


RELEASE = '''
    def _release_unheaded_tool_start(self) -> list[SemanticEvent]:
        """Release the held <tool_call>: it opened no call.

        The tag and the text held after it become one content chunk, back in the content
        state, and the call is taken back: its index, and its start event, which becomes an
        empty text chunk. Not yet returned (the tag came in this delta), the caller then sees
        no call at all; returned with an earlier delta, it opened a call that stays empty,
        and callers skip a call without a name.
        """
        start = self._held_tool_start
        released = start.value + self._held_preamble
        self._held_tool_start, self._held_preamble = None, ""
        self.state = ParserState.CONTENT
        self.tool_index -= 1
        start.type, start.value = EventType.TEXT_CHUNK, ""
        return [
            SemanticEvent(EventType.TEXT_CHUNK, value=released, tool_index=self.tool_index)
        ]

    def _held_preamble_may_be_header(self) -> bool:
        """The held text is whitespace, or whitespace then the start of a call header."""
        held = self._held_preamble.lstrip()
        for (state, terminal), transition in self.config.transitions.items():
            if state != ParserState.TOOL_PREAMBLE or transition.next_state == ParserState.CONTENT:
                continue
            spellings = self.config.terminals.get(terminal, ())
            for spelling in (spellings,) if isinstance(spellings, str) else spellings:
                if spelling.startswith(held):
                    return True
        return False
'''


class HoldPreambleText(Codemod):
    """Text reaching ``_emit_for_state`` while a tag is held is held with it."""

    target = ENGINE_FILE
    anchor = (ENGINE, func("_emit_for_state"))
    patched = (ENGINE, func("_release_unheaded_tool_start", leading_lines=marked("K1")))

    def rewrite(self, node):
        (guard,) = statements(
            """
            if self._held_tool_start is not None and self.state == ParserState.TOOL_PREAMBLE:
                self._held_preamble += text
                return []
            """
        )
        why = "a held <tool_call>: its text waits for <function=, </tool_call> or the end"
        body = node.body.with_changes(body=[with_marker(guard, "K1", why), *node.body.body])
        holder = statements("class _:\n" + RELEASE)[0]
        release, may_be_header = holder.body.body
        release = with_marker(release.with_changes(leading_lines=[]), "K1",
                              "release a <tool_call> no <function= header follows")
        return insert_after(node.with_changes(body=body), release, may_be_header.with_changes(leading_lines=[]))


def _has_param(node: cst.FunctionDef, name: str) -> bool:
    return any(param.name.value == name for param in node.params.params)


class ReleaseBeforeAnotherOpener(Codemod):
    """A content-state terminal (a second ``<tool_call>``) after held text releases the tag."""

    target = ENGINE_FILE
    anchor = (ENGINE, func("_on_terminal"))
    patched = (ENGINE, func("_on_terminal"), m.If(leading_lines=marked("K1")))

    def rewrite(self, node):
        again = "terminal, value, token_count" if _has_param(node, "token_count") else "terminal, value"
        (guard,) = statements(
            f"""
            if (
                self._held_tool_start is not None
                and self.state == ParserState.TOOL_PREAMBLE
                and (self.state, terminal) not in self.config.transitions
                and (ParserState.CONTENT, terminal) in self.config.transitions
                and self._held_preamble.strip()
            ):
                return self._release_unheaded_tool_start() + self._on_terminal({again})
            """
        )
        why = "text then another <tool_call> before any <function=: the first tag was prose"
        return node.with_changes(body=node.body.with_changes(body=[with_marker(guard, "K1", why),
                                                                   *node.body.body]))


ARGS_BUFFER_CHECK = m.If(test=m.Attribute(value=m.Name("self"), attr=m.Name("_args_buffer")))


class ReleaseAtEnd(Codemod):
    """At the end, held text that cannot begin a header releases the tag as content."""

    target = ENGINE_FILE
    anchor = (ENGINE, func("finish"), ARGS_BUFFER_CHECK)
    patched = (ENGINE, func("finish"), m.If(leading_lines=marked("K1")))

    def rewrite(self, node):
        (release,) = statements(
            """
            if (
                self._held_tool_start is not None
                and self.state == ParserState.TOOL_PREAMBLE
                and not self._held_preamble_may_be_header()
            ):
                events.extend(self._release_unheaded_tool_start())
            """
        )
        why = "a truncated opener (<tool_call>, then whitespace or part of <function=) stays dropped"
        return insert_before(node, with_marker(release, "K1", why))


class K1(Patch):
    id = "K1"
    family = "tool_parsing"
    title = "qwen3 parser engine: a <tool_call> without a <function= header is streamed as content"
    why = (
        "The parser engine drops all text after a <tool_call> until a <function= header or "
        "</tool_call>: a tag mentioned in prose or mid-thought silences the stream and loses "
        "the text after it (streaming and non-streaming), and shifts later call indices."
    )
    upstream_refs = ("club-3090#72",)
    written_for = ">=0.20.1"
    gates = Gates(vllm=">=0.24.0")
    edits = (AddReleaseFlag, Qwen3ConfigReleasesUnheadedCalls, HeldToolStartState, HoldOnEnteringPreamble,
             HoldPreambleText, ReleaseBeforeAnotherOpener, ReleaseAtEnd)
