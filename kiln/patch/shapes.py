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

from kiln.patch.anchor import Anchor, find, line_of, reach


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


def kiln_marked(node: cst.CSTNode, patch_id: str | None = None) -> bool:
    """The node was written by a kiln patch (``patch_id``'s, or any when None): its leading
    lines carry a marker. For ``upstream_fix`` recognisers: kiln's own rewrite of a shape, met
    again on a re-run or after another patch of the selection, is not vLLM's fix."""
    prefix = f"# kiln {patch_id}:" if patch_id else "# kiln "
    return any(line.comment is not None and line.comment.value.startswith(prefix)
               for line in getattr(node, "leading_lines", ()))


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


# -- upstream recognisers several patches share ---------------------------------------------
# A patch module may not import another's (each patch's verdict memo covers only its own
# module; this file is part of every key), so a recogniser two patches need lives here once.

HYBRID_PLATFORM = "platforms/interface.py"
UNIFY_PAGE_SIZE = "unify_kv_cache_spec_page_size"
UNIFY_FILES = ("v1/core/kv_cache_planning.py", "v1/core/kv_cache_utils.py")  # from 0.33.0; before
_ALIGN_HYBRID = (cls("Platform"), func("_align_hybrid_block_size"))
_TQ_CACHE_DTYPE = m.Call(
    func=m.Attribute(attr=m.Name("startswith")), args=[m.Arg(value=m.SimpleString('"turboquant_"'))]
)
_PADS_TO_PAGE = m.Call(
    func=m.Name("replace"),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("page_size_padded")), m.ZeroOrMore()],
)


def _isinstance_of(spec: str) -> m.Call:
    return m.Call(func=m.Name("isinstance"), args=[m.Arg(), m.Arg(value=m.Name(spec))])


def platform_sizes_turboquant_pages(module_of) -> str | None:
    """``file:line`` of the branch of ``Platform._align_hybrid_block_size`` that sizes the
    per-token attention page of a ``turboquant_*`` cache from its packed layout (vllm#39931)."""
    module = module_of(HYBRID_PLATFORM)
    if module is None:
        return None
    for branch in reach(module, (*_ALIGN_HYBRID, m.If())):
        if m.findall(branch.test, _TQ_CACHE_DTYPE) and find(branch.body, assign_to("attn_page_size_1_token")):
            return place(HYBRID_PLATFORM, module, branch)
    return None


def unify_pads_pages(module_of, *specs: str) -> str | None:
    """``file:line`` of vLLM's own ``unify_kv_cache_spec_page_size`` where it pads the pages of
    every spec in ``specs`` (e.g. ``MambaSpec``) to the largest page instead of raising or
    scaling their block size (vllm#45207 and its predecessors); kiln's own rewrites (marked) do
    not count."""
    for rel in UNIFY_FILES:
        module = module_of(rel)
        if module is None:
            continue
        for fn in find(module, func(UNIFY_PAGE_SIZE)):
            if kiln_marked(fn):
                continue
            if m.findall(fn, _PADS_TO_PAGE) and all(m.findall(fn, _isinstance_of(spec)) for spec in specs):
                return place(rel, module, fn)
    return None
