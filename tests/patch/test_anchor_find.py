"""``find`` and ``count``: the nodes libcst's ``m.findall`` finds, in its (source) order, found
by reading the nodes' fields instead of a libcst visit (which rebuilds every node it passes).

Compared with ``m.findall`` for matchers of one node type, of several (``OneOf``), and predicates
(``MatchIfTrue``), on a module built to hold nested and repeated shapes and on vLLM's largest
file of each pin.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
import pytest

from kiln.patch.anchor import child_nodes, count, find

SOURCE = '''\
import os


@decorator(os.sep)
def outer(a, b=os.sep):
    def inner(c):
        return [os.path.join(c, d) for d in os.listdir(c) if d]
    x = {"k": (a, b), **{"j": os.sep}}
    return inner(x["k"]), (lambda y: y.attr.attr)(1)


class Holder:
    attr: int = os.sep

    async def run(self):
        async with self.lock as held:
            await held.call(os.sep, key=os.sep)
'''

MATCHERS = [
    m.Name("os"),
    m.Attribute(value=m.Name("os"), attr=m.Name("sep")),
    m.Call(),
    m.Arg(keyword=m.Name("key")),
    m.OneOf(m.Name("a"), m.Name("b"), m.Name("c")),
    m.MatchIfTrue(lambda node: isinstance(node, cst.Integer)),
    m.TypeOf(m.Subscript, m.Dict),
    m.Lambda(),
    m.Param(),
    m.Comma(),
    m.FunctionDef(),  # (a statement matcher: kiln walks statement blocks)
    m.SimpleStatementLine(),
    m.Name("nowhere"),
]


def _findall(root: cst.CSTNode, matcher) -> list[cst.CSTNode]:
    return [node for node in m.findall(root, matcher) if node is not root]


def _same(found: list[cst.CSTNode], expected: list[cst.CSTNode]) -> bool:
    return len(found) == len(expected) and all(a is b for a, b in zip(found, expected, strict=True))


@pytest.mark.parametrize("matcher", MATCHERS, ids=lambda matcher: type(matcher).__name__)
def test_find_is_libcsts_findall_in_its_order(matcher):
    module = cst.parse_module(SOURCE)
    for root in (module, module.body[1], module.body[2]):
        expected = _findall(root, matcher)
        assert _same(find(root, matcher), expected)
        assert count(root, (matcher,)) == len(expected)
    assert len(_findall(module, m.Name("os"))) > 5  # (the module does hold repeats)


def test_child_nodes_are_the_children_libcst_visits():
    module = cst.parse_module(SOURCE)
    for node in _findall(module, m.MatchIfTrue(lambda node: True)):
        assert {id(child) for child in child_nodes(node)} == {id(child) for child in node.children}


@pytest.mark.network
@pytest.mark.parametrize("label", ["v0.20.1", "v0.33.0"])
def test_find_is_libcsts_findall_on_the_pins_largest_file(trees, label):
    tree = trees(label)
    module = cst.parse_module(tree.read("v1/worker/gpu_model_runner.py"))
    [runner] = find(module, m.ClassDef(name=m.Name("GPUModelRunner")))
    for matcher in (m.Attribute(value=m.Name("self"), attr=m.Name("input_batch")), m.Call(func=m.Name("len")),
                    m.Name("None"), m.OneOf(m.Integer("0"), m.Integer("1")), m.Comparison()):
        expected = _findall(runner, matcher)
        assert len(expected) > 2
        assert _same(find(runner, matcher), expected)
        assert count(module, (m.ClassDef(name=m.Name("GPUModelRunner")), matcher)) == len(expected)
