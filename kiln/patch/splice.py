"""Putting a rewritten node back into a module, cheaply.

Public API:
    replace_node(module, old, new, scope=None) -> Module

A statement is spliced in along its chain of blocks; anything smaller is replaced within the
statement that holds it (its anchor's ``scope``); only without one is the whole module
transformed. Rebuilding only the blocks from the module down to the statement is what keeps an
edit of a 7,000-line file cheap: a full-tree transform visits every expression node.
"""

from __future__ import annotations

import libcst as cst


class _Replace(cst.CSTTransformer):
    """Replace one node, by identity, anywhere in a tree (the general but slow path)."""

    def __init__(self, old: cst.CSTNode, new):
        self.old, self.new, self.hits = old, new, 0

    def on_leave(self, original_node, updated_node):
        if original_node is self.old:
            self.hits += 1
            return self.new
        return updated_node


def _splice(items, old, new):
    """``items`` with ``old`` replaced (recursing into compound statements), or None."""
    for index, item in enumerate(items):
        if item is old:
            if isinstance(new, cst.FlattenSentinel):
                replacement = list(new.nodes)
            elif isinstance(new, cst.RemovalSentinel):
                replacement = []
            else:
                replacement = [new]
            return [*items[:index], *replacement, *items[index + 1 :]]
        if isinstance(item, cst.CSTNode):
            rebuilt = _rebuild(item, old, new)
            if rebuilt is not None:
                return [*items[:index], rebuilt, *items[index + 1 :]]
    return None


def _rebuild(node: cst.CSTNode, old: cst.CSTNode, new) -> cst.CSTNode | None:
    """``node`` with the statement ``old`` replaced, walking statement blocks only; or None.

    Rebuilding only the chain of blocks from the module down to the statement is what keeps
    an edit of a 7,000-line file cheap: a full-tree transform visits every expression node.
    """
    for attr in ("body", "orelse", "handlers", "finalbody"):
        value = getattr(node, attr, None)
        if value is None:
            continue
        if isinstance(value, cst.BaseSuite):
            items = _splice(value.body, old, new)
            if items is not None:
                return node.with_changes(**{attr: value.with_changes(body=items)})
        elif isinstance(value, (list, tuple)):
            items = _splice(value, old, new)
            if items is not None:
                return node.with_changes(**{attr: items})
        elif isinstance(value, cst.CSTNode):
            if value is old and isinstance(new, cst.CSTNode):
                return node.with_changes(**{attr: new})
            rebuilt = _rebuild(value, old, new)
            if rebuilt is not None:
                return node.with_changes(**{attr: rebuilt})
    return None


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
    rebuilt = _rebuild(module, old, new)
    if rebuilt is not None:
        return rebuilt
    if scope is not None and scope is not module:
        new_scope = _transform(scope, old, new)
        rebuilt = _rebuild(module, scope, new_scope)
        if rebuilt is not None:
            return rebuilt
    return _transform(module, old, new)
