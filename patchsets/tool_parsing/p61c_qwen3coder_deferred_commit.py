"""P61c: qwen3_coder streaming commits to a tool call only once ``<function=`` follows ``<tool_call>``.

What fails on 0.20.1: ``Qwen3CoderToolParser.extract_tool_calls_streaming`` sets
``is_tool_call_started`` on the first ``<tool_call>`` it sees and from then on returns ``None``
until a ``<function=`` header appears. When the model writes the tag without a call after it
(it mentions the tag in prose, or, under the qwen3 reasoning parser, emits it mid-thought,
which ends reasoning and hands the rest of the output to the tool parser; or it writes a
Hermes-style JSON body, ``<tool_call>{"name": ...}``), everything after the tag is swallowed:
the client's stream goes silent (Genesis measured a 58 s gap on club-3090#72's case) and,
when no header ever comes, the text is never sent at all. The non-streaming parser returns the same output as
content (it looks for ``<function=`` first), so streaming and non-streaming disagree.
A later real call after such a tag is mis-indexed too: the parser counts ``<tool_call>`` tags
in the whole text, so the narrative tag is taken as call 0, the real call is located again as
a second call (empty arguments) and the text after it is swallowed as well.

What the patch does: the tag no longer commits by itself. From the tag on, text is held while
what follows it (leading whitespace aside) can still become ``<function=``; once it is the
header, the call is committed (in the same delta when the header completes, the header is
processed right away), and once it cannot be, the held text is released as content in one
delta and the tag is blanked out of the parser's view of ``current_text`` (same length), so
later calls are counted and located as if it had never been there. The common stream
``<tool_call>``, ``\\n<function=NAME>`` streams exactly as before. Not covered: a stream
that ends while a tag is held (the original also sent nothing); a ``</tool_call>`` typed in
prose after a released tag still counts as a call end.

Genesis's version (by reading its code; not run here) releases the tag as content unless
``<function=`` is already within 64 characters after it in that delta's text, so a
``<tool_call>`` delta followed by the header in the next delta (the usual shape without MTP)
would be emitted as content and the call lost; this version waits for the header instead.

Upstream: none for this parser (Genesis-original, from club-3090#72).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.23.0: APPLIES (``tool_parsers/qwen3coder_tool_parser.py``, unchanged where the
  codemods anchor).
- 0.24.0 on: GATED (``vllm<0.24.0``); before the gate it read TARGET_GONE. vllm#45413 removed
  ``qwen3coder_tool_parser.py``: ``qwen3_coder`` is served by ``Qwen3EngineToolParser``
  (``tool_parsers/qwen3_engine_tool_parser.py``), an adapter of the streaming parser engine.
  The failure survived there (the text after a header-less tag is dropped in streaming and
  non-streaming alike), so the fix was ported rather than retired: K1 carries it on the
  engine from 0.24.0, and this patch is gated to the releases its file exists in, so an
  image lists both and each pin gets the one that fits.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import (
    cls,
    func,
    insert_after,
    insert_before,
    marked,
    statements,
    with_marker,
)

TARGET = "tool_parsers/qwen3coder_tool_parser.py"
PARSER = cls("Qwen3CoderToolParser")
STREAMING = (PARSER, func("extract_tool_calls_streaming"))


def _assigns_self(attr: str, **kwargs) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(
        body=[m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))])],
        **kwargs,
    )


def _methods(source: str) -> list[cst.FunctionDef]:
    """Parse methods written at class-body indentation."""
    (holder,) = statements("class _:\n" + source)
    return [method.with_changes(leading_lines=[]) for method in holder.body.body]


class AddDeferralState(Codemod):
    """Per-stream state: the held tag's position, and the spans released as content."""

    target = TARGET
    anchor = (PARSER, func("_reset_streaming_state"), _assigns_self("streaming_request"))
    patched = (PARSER, func("_reset_streaming_state"), _assigns_self("held_tool_call_at", leading_lines=marked("P61c")))

    def rewrite(self, node):
        held, released = statements(
            """
            self.held_tool_call_at = None  # a <tool_call> waiting for its <function= header
            self.released_tool_call_spans = []  # text from a <tool_call> sent as content
            """
        )
        why = "a <tool_call> commits to a call only once its <function= header follows"
        return insert_after(node, with_marker(held, "P61c", why), released, blank_line=False)


METHODS = '''
    def _visible_tool_text(self, current_text: str) -> str:
        """``current_text`` with the tags inside released spans blanked (same length)."""
        for start, end in self.released_tool_call_spans:
            span = current_text[start:end]
            for tag in (self.tool_call_start_token, self.tool_call_end_token):
                span = span.replace(tag, " " * len(tag))
            current_text = current_text[:start] + span + current_text[end:]
        return current_text

    def _defer_tool_call_commit(
        self, current_text: str, delta_text: str, delta_token_ids: Sequence[int]
    ) -> tuple[DeltaMessage | None] | None:
        """Decide a <tool_call> by what follows it.

        Returns None to go on: no tag is pending, or the tag has its <function= header
        (the call is committed). Else a 1-tuple with what to return for this delta: the
        content before a held tag (or None), or the held text released as content.
        """
        tag = self.tool_call_start_token
        delta_start = len(current_text) - len(delta_text)
        before = ""
        at = self.held_tool_call_at
        if at is None:
            if self.tool_call_start_token_id not in delta_token_ids and tag not in delta_text:
                return None
            at = current_text.find(tag, delta_start)
            if at == -1:  # the token without its text: commit, as before
                return None
            before = current_text[delta_start:at]
        released = ""
        while True:
            rest = current_text[at + len(tag) :].lstrip()
            if rest.startswith(self.tool_call_prefix):
                self.held_tool_call_at = None
                self.is_tool_call_started = True
                if before or released:
                    # as before: the header is processed from the next delta on
                    return (DeltaMessage(content=before + released),)
                return None
            if self.tool_call_prefix.startswith(rest):
                self.held_tool_call_at = at
                text = before + released
                return (DeltaMessage(content=text) if text else None,)
            following = current_text.find(tag, at + len(tag))
            end = following if following != -1 else len(current_text)
            released += current_text[at:end]
            self.released_tool_call_spans.append((at, end))
            if following == -1:
                self.held_tool_call_at = None
                return (DeltaMessage(content=before + released),)
            at = following
'''


class AddDeferralMethods(Codemod):
    target = TARGET
    anchor = (PARSER, func("_reset_streaming_state"))
    patched = (PARSER, func("_visible_tool_text", leading_lines=marked("P61c")))

    def rewrite(self, node):
        visible, defer = _methods(METHODS)
        return insert_after(
            node,
            with_marker(visible, "P61c", "tags released as content are not tool calls"),
            defer,
        )


# `if not previous_text: ...` (a new stream: reset the state)
NEW_STREAM = m.If(test=m.UnaryOperation(operator=m.Not(), expression=m.Name("previous_text")))


class HideReleasedTags(Codemod):
    """The parser counts and locates ``<tool_call>`` tags in a view without released ones."""

    target = TARGET
    anchor = (*STREAMING, NEW_STREAM)
    patched = (*STREAMING, m.SimpleStatementLine(leading_lines=marked("P61c")))

    def rewrite(self, node):
        (view,) = statements("current_text = self._visible_tool_text(current_text)")
        why = "a released <tool_call> must not count as a call (same length: positions hold)"
        return insert_after(node, with_marker(view, "P61c", why), blank_line=False)


# `if not self.is_tool_call_started:` (content, or the start of a call)
NOT_STARTED = m.If(
    test=m.UnaryOperation(operator=m.Not(), expression=m.Attribute(attr=m.Name("is_tool_call_started")))
)


class DeferCommit(Codemod):
    target = TARGET
    anchor = (*STREAMING, NOT_STARTED)
    patched = (*STREAMING, m.If(leading_lines=marked("P61c")))

    def rewrite(self, node):
        (defer,) = statements(
            """
            if not self.is_tool_call_started:
                deferred = self._defer_tool_call_commit(current_text, delta_text, delta_token_ids)
                if deferred is not None:
                    return deferred[0]
            """
        )
        why = "hold a <tool_call> until <function= follows it; release it as content if it cannot"
        # the comment above the original `if` stays above the new one
        moved = with_marker(defer.with_changes(leading_lines=node.leading_lines), "P61c", why)
        return insert_before(node.with_changes(leading_lines=[]), moved)


class P61c(Patch):
    id = "P61c"
    family = "tool_parsing"
    title = "qwen3_coder streaming: a <tool_call> without a <function= header is streamed as content"
    why = (
        "The streaming parser committed to a tool call on the <tool_call> tag alone; a tag "
        "mentioned in prose or mid-thought silenced the stream and swallowed the text after it, "
        "which the non-streaming parser returns as content."
    )
    upstream_refs = ("club-3090#72",)
    written_for = ">=0.20.1"
    gates = Gates(vllm="<0.24.0")  # from 0.24.0: K1, on the parser engine
    edits = (AddDeferralState, AddDeferralMethods, HideReleasedTags, DeferCommit)
