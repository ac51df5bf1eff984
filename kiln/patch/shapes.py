"""Helpers patch modules use to build matchers and emitted code.

Every block a patch emits starts with a marker comment ``# kiln <ID>: <why>``. The marker
tells a reader of the image's source (or of a traceback) which patch wrote the code, and it
is what ``patched`` matchers look for, so a pristine tree whose upstream code happens to
look like the fix is reported ``UPSTREAM``, never ``ALREADY_PATCHED``.
"""

from __future__ import annotations

import textwrap

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import Anchor, line_of, reach


def marker_text(patch_id: str, why: str) -> str:
    return f"# kiln {patch_id}: {why}"


def marker_line(patch_id: str, why: str) -> cst.EmptyLine:
    return cst.EmptyLine(comment=cst.Comment(marker_text(patch_id, why)))


def marked(patch_id: str) -> list:
    """A ``leading_lines=`` matcher: the node is preceded by this patch's marker comment."""
    prefix = f"# kiln {patch_id}:"
    return [
        m.ZeroOrMore(),
        m.EmptyLine(comment=m.Comment(m.MatchIfTrue(lambda text: text.startswith(prefix)))),
        m.ZeroOrMore(),
    ]


def unmarked(patch_id: str) -> list:
    """A ``leading_lines=`` matcher: no marker of this patch above the node.

    For ``upstream`` matchers whose shape is the patch's own: vLLM's code of that shape is
    upstream, kiln's marked copy is not (a re-run stays ``ALREADY_PATCHED``).
    """
    prefix = f"# kiln {patch_id}:"
    return [m.ZeroOrMore(~m.EmptyLine(comment=m.Comment(m.MatchIfTrue(lambda text: text.startswith(prefix)))))]


def cls(name: str) -> m.ClassDef:
    return m.ClassDef(name=m.Name(name))


def func(name: str, **kwargs) -> m.FunctionDef:
    return m.FunctionDef(name=m.Name(name), **kwargs)


def assign_to(name: str) -> m.SimpleStatementLine:
    """A statement line assigning (plainly or annotated) to the bare name ``name``."""
    return m.SimpleStatementLine(
        body=[
            m.OneOf(
                m.AnnAssign(target=m.Name(name)),
                m.Assign(targets=[m.AssignTarget(target=m.Name(name))]),
            )
        ]
    )


def statements(source: str, *, indent: str = "") -> list[cst.BaseStatement]:
    """Parse a block of statements written as ordinary (dedented) source text."""
    module = cst.parse_module(textwrap.dedent(source).strip("\n") + "\n")
    body = list(module.body)
    if body and module.header:
        # libcst files comments above the first statement under the module header; keep them
        # with the statement they describe.
        body[0] = body[0].with_changes(leading_lines=[*module.header, *body[0].leading_lines])
    return body


def with_marker(node: cst.BaseStatement, patch_id: str, why: str) -> cst.BaseStatement:
    """Prefix a statement (or def/class) with the patch marker comment."""
    return node.with_changes(leading_lines=[*node.leading_lines, marker_line(patch_id, why)])


def insert_after(node: cst.BaseStatement, *new: cst.BaseStatement, blank_line: bool = True) -> cst.FlattenSentinel:
    """Keep ``node`` and put ``new`` statements right after it (a blank line before each)."""
    spaced = [
        n.with_changes(leading_lines=[cst.EmptyLine(indent=False), *n.leading_lines]) if blank_line else n for n in new
    ]
    return cst.FlattenSentinel([node, *spaced])


def insert_before(node: cst.BaseStatement, *new: cst.BaseStatement) -> cst.FlattenSentinel:
    """Put ``new`` statements right before ``node``."""
    return cst.FlattenSentinel([*new, node])


def top_level(node: cst.BaseStatement, patch_id: str, why: str) -> cst.BaseStatement:
    """A module-level statement as PEP 8 places it: two blank lines, then the marker."""
    blank = cst.EmptyLine(indent=False)
    return node.with_changes(leading_lines=[blank, blank, marker_line(patch_id, why)])


def place(rel: str, module: cst.Module, node: cst.CSTNode) -> str:
    """``rel:line`` of ``node`` in ``module``: where an upstream fix lives, for a verdict's detail."""
    line = line_of(module, node)
    return f"{rel}:{line}" if line else rel


def place_of(rel: str, module: cst.Module | None, anchor: Anchor) -> str | None:
    """``rel:line`` of the first node ``anchor`` reaches in ``module``, or None if none."""
    if module is None:
        return None
    nodes = reach(module, anchor)
    return place(rel, module, nodes[0]) if nodes else None
