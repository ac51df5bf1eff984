"""Putting a rewritten node back into a module, cheaply.

Public API:
    replace_node(module, old, new, scope=None) -> Module
    replace_traced(module, old, new, scope=None) -> (Module, Splice | None)

A statement is spliced in along its chain of blocks; anything smaller is replaced within the
statement that holds it (its anchor's ``scope``); only without one is the whole module
transformed. Rebuilding only the blocks from the module down to the statement is what keeps an
edit of a 7,000-line file cheap: a full-tree transform visits every expression node.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from kiln.patch.anchor import child_nodes


@dataclass(frozen=True)
class Splice:
    """A statement of a block (the module's body or an indented block's) replaced by statements:
    the code around it is unchanged (``kiln.patch.codegen`` splices the text the same way).
    ``indent`` is the indentation libcst writes the block's statements at (one string per
    enclosing indented block)."""

    old: cst.BaseStatement
    new: tuple[cst.BaseStatement, ...]
    indent: tuple[str, ...]


class _Replace(cst.CSTTransformer):
    """Replace one node, by identity, anywhere in a tree (the general but slow path)."""

    def __init__(self, old: cst.CSTNode, new):
        self.old, self.new, self.hits = old, new, 0

    def on_leave(self, original_node, updated_node):
        if original_node is self.old:
            self.hits += 1
            return self.new
        return updated_node


def _replacement(new) -> list:
    if isinstance(new, cst.FlattenSentinel):
        return list(new.nodes)
    if isinstance(new, cst.RemovalSentinel):
        return []
    return [new]


class _Rebuild:
    """``node`` with the statement ``old`` replaced, walking statement blocks only (None where
    ``old`` is not under it); ``listed`` says whether it was an item of a list (a body, not a
    single child such as an ``elif``)."""

    def __init__(self, old: cst.CSTNode, new, default_indent: str):
        self.old, self.new, self.listed = old, new, False
        self.default_indent = default_indent
        self.indent: tuple[str, ...] = ()  # where ``old`` was found

    def splice(self, items, indent: tuple[str, ...]):
        """``items`` (written at ``indent``) with ``old`` replaced (recursing into compound
        statements), or None."""
        for index, item in enumerate(items):
            if item is self.old:
                self.listed, self.indent = True, indent
                return [*items[:index], *_replacement(self.new), *items[index + 1:]]
            if isinstance(item, cst.CSTNode):
                rebuilt = self.rebuild(item, indent)
                if rebuilt is not None:
                    return [*items[:index], rebuilt, *items[index + 1:]]
        return None

    def rebuild(self, node: cst.CSTNode, indent: tuple[str, ...] = ()) -> cst.CSTNode | None:
        for attr in ("body", "orelse", "handlers", "finalbody"):
            value = getattr(node, attr, None)
            if value is None:
                continue
            if isinstance(value, cst.BaseSuite):
                inner = indent  # (a one-line suite holds small statements, written on its line)
                if isinstance(value, cst.IndentedBlock):  # as libcst's code generation indents it
                    inner = (*indent, self.default_indent if value.indent is None else value.indent)
                items = self.splice(value.body, inner)
                if items is not None:
                    return node.with_changes(**{attr: value.with_changes(body=items)})
            elif isinstance(value, (list, tuple)):
                items = self.splice(value, indent)
                if items is not None:
                    return node.with_changes(**{attr: items})
            elif isinstance(value, cst.CSTNode):
                if value is self.old and isinstance(self.new, cst.CSTNode):
                    return node.with_changes(**{attr: self.new})
                rebuilt = self.rebuild(value, indent)
                if rebuilt is not None:
                    return node.with_changes(**{attr: rebuilt})
        return None

    def traced(self) -> Splice | None:
        """The splice, when a statement was replaced by statements in a list: a list holding a
        statement is a module's or an indented block's body (a one-line suite holds small
        statements, a ``try`` its handlers)."""
        statements = tuple(_replacement(self.new))
        if self.listed and isinstance(self.old, cst.BaseStatement) and \
                all(isinstance(s, cst.BaseStatement) for s in statements):
            return Splice(self.old, statements, self.indent)
        return None


def _holder(scope: cst.CSTNode, old: cst.CSTNode) -> cst.CSTNode:
    """The innermost statement under ``scope`` that holds ``old`` (``scope`` itself when none
    does, or when ``old`` is not there): transforming it, not all of ``scope`` (a class of
    hundreds of lines), is what an expression's edit costs. Found by reading the nodes' fields,
    which builds nothing (a libcst visit rebuilds every node it passes)."""
    stack: list[tuple[cst.CSTNode, cst.CSTNode]] = [(scope, scope)]  # (node, innermost statement holding it)
    while stack:
        node, holder = stack.pop()
        if node is old:
            return holder
        if isinstance(node, cst.BaseStatement):
            holder = node
        stack.extend((child, holder) for child in child_nodes(node))
    return scope


def _transform(root: cst.CSTNode, old: cst.CSTNode, new) -> cst.CSTNode:
    transformer = _Replace(old, new)
    result = root.visit(transformer)
    if transformer.hits != 1:
        raise RuntimeError("anchored node not found during replacement")
    return result


def replace_node(module: cst.Module, old: cst.CSTNode, new, scope: cst.CSTNode | None = None) -> cst.Module:
    """``module`` with ``old`` replaced by ``new``.

    A statement is spliced in along its chain of blocks. Anything smaller (an expression) is
    replaced by a transform of its ``scope`` (the statement its anchor was found in), which is
    then spliced in; only without a usable scope is the whole module transformed.
    """
    return replace_traced(module, old, new, scope)[0]


def replace_traced(module: cst.Module, old: cst.CSTNode, new,
                   scope: cst.CSTNode | None = None) -> tuple[cst.Module, Splice | None]:
    """``replace_node``, and the statement of a block it replaced with what (None: another kind
    of replacement, or the whole module transformed)."""
    direct = _Rebuild(old, new, module.default_indent)
    rebuilt = direct.rebuild(module)
    if rebuilt is not None:
        return rebuilt, direct.traced()
    if scope is not None and scope is not module:
        scope = _holder(scope, old)
        around = _Rebuild(scope, _transform(scope, old, new), module.default_indent)
        rebuilt = around.rebuild(module)
        if rebuilt is not None:
            return rebuilt, around.traced()
    return _transform(module, old, new), None
