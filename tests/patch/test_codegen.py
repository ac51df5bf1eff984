"""kiln/patch/codegen.py: a patched module's text is its parent's with the edit spliced in, and
always equals libcst's own code generation of the module, on hand-made edits and on every patch
of the catalogue on the pins' real files."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
from packaging.version import Version

from kiln import paths
from kiln.patch.catalog import load_catalogue
from kiln.patch.codegen import TEXTS, _Texts
from kiln.patch.engine import Session, isolated_run, run_selection
from kiln.patch.model import BuildTarget
from kiln.patch.splice import replace_traced

SOURCE = textwrap.dedent('''\
    """A module."""
    import os


    class Builder:
        # the builder
        def build(self, x):
            if x:
                return 1
            elif x is None:
                return 2
            else:
                return 3

        def other(self):
            return os.sep  # trailing comment
    ''')


def _find(module: cst.Module, kind, predicate=lambda node: True):
    found = []

    class Visitor(cst.CSTVisitor):
        def on_visit(self, node):
            if isinstance(node, kind) and predicate(node):
                found.append(node)
            return True

    module.visit(Visitor())
    return found


def _edit(texts: _Texts, module: cst.Module, old, new, scope=None) -> tuple[cst.Module, bool]:
    new_module, splice = replace_traced(module, old, new, scope)
    return new_module, splice is not None and texts.spliced(module, new_module, splice.old, splice.new, splice.indent)


@pytest.fixture
def parsed():
    texts = _Texts()
    module = cst.parse_module(SOURCE)
    texts.known(module, SOURCE)
    return texts, module


def test_a_method_replaced_in_a_class_is_spliced_and_equals_libcsts_text(parsed):
    texts, module = parsed
    [other] = _find(module, cst.FunctionDef, lambda f: f.name.value == "other")
    new = cst.parse_statement("def other(self):\n    return os.linesep\n")
    changed, spliced = _edit(texts, module, other, new)
    assert spliced and texts.code(changed) == changed.code
    assert "return os.linesep" in texts.code(changed) and "# the builder" in texts.code(changed)
    # a second edit of the result starts from the spliced text, and is indented as libcst indents it
    [ret] = _find(changed, cst.SimpleStatementLine, lambda s: "return 1" in changed.code_for_node(s))
    flat = cst.FlattenSentinel([cst.parse_statement("y = 1\n"), cst.parse_statement("return y\n")])
    again, spliced = _edit(texts, changed, ret, flat)
    assert spliced and texts.code(again) == again.code and "            y = 1\n            return y\n" in again.code


def test_an_expression_edit_splices_the_innermost_statement_that_holds_it(parsed):
    texts, module = parsed
    [build] = _find(module, cst.FunctionDef, lambda f: f.name.value == "build")
    [three] = _find(build, cst.Integer, lambda i: i.value == "3")
    changed, spliced = _edit(texts, module, three, cst.Integer("4"), scope=build)
    assert spliced and texts.code(changed) == changed.code and "return 4" in changed.code


def test_what_cannot_be_spliced_is_left_to_libcst_and_still_right(parsed):
    texts, module = parsed
    # an elif is its If's `orelse`, not a statement of a block: libcst writes "elif" from its parent
    [elif_] = _find(module, cst.If, lambda node: "None" in module.code_for_node(node.test))
    changed, spliced = _edit(texts, module, elif_, elif_.with_changes(test=cst.parse_expression("x == 0")))
    assert not spliced and texts.code(changed) == changed.code and "elif x == 0:" in changed.code
    # a block emptied: libcst writes `pass` there
    [ret] = _find(module, cst.SimpleStatementLine, lambda s: "os.sep" in module.code_for_node(s))
    changed, spliced = _edit(texts, module, ret, cst.RemoveFromParent())
    assert not spliced and texts.code(changed) == changed.code and "pass" in changed.code
    # a module without its final newline (libcst drops the last token)
    bare = cst.parse_module("x = 1\ny = 2")
    texts.known(bare, "x = 1\ny = 2")
    changed, spliced = _edit(texts, bare, bare.body[1], cst.parse_statement("y = 3\n"))
    assert not spliced and texts.code(changed) == changed.code == "x = 1\ny = 3"


def test_a_statement_the_module_holds_twice_is_not_spliced_by_its_span():
    texts = _Texts()
    shared = cst.parse_statement("x = 1\n")
    module = cst.Module(body=[shared, cst.parse_statement("def f():\n    pass\n"), shared])
    texts.known(module, module.code)
    changed, spliced = _edit(texts, module, shared, cst.parse_statement("x = 2\n"))
    assert not spliced and texts.code(changed) == changed.code == "x = 2\ndef f():\n    pass\nx = 1\n"


@pytest.mark.network
@pytest.mark.parametrize("label", ["v0.20.1", "v0.33.0"])
def test_every_patch_on_the_pins_real_files_has_libcsts_text(trees, label, monkeypatch):
    """Every patch alone (as ``verify`` runs them) and all together (as a build does), on the
    pin's real files: each changed module's text equals libcst's, and most were spliced; most of
    the selection's files are known to parse without parsing them again, and they do."""
    made = {"spliced": 0, "generated": 0}
    spliced = TEXTS.spliced

    def counting(*args):
        done = spliced(*args)
        made["spliced" if done else "generated"] += 1
        return done

    monkeypatch.setattr(TEXTS, "spliced", counting)
    catalogue = load_catalogue(paths.PATCHSETS)
    tree = trees(label)
    session, target = Session(tree), BuildTarget(vllm_version=Version(str(tree.vllm_version)))
    runs = [isolated_run(catalogue, session, target, pid) for pid in catalogue.patches]
    runs.append(run_selection(catalogue, session, target, list(catalogue.patches)))
    # the whole selection's files: most are vouched to parse, and do (a file edited again after
    # its text's record made way for newer ones is generated, and parsed again by the selection)
    vouched = [module for module in runs[-1].state.changed.values() if TEXTS.parses(module)]
    assert len(vouched) > 0.5 * len(runs[-1].state.changed)
    for module in vouched:
        cst.parse_module(session.code(module))
    changed = [module for run in runs for module in run.state.changed.values()]
    assert len(changed) > 20
    for module in changed:
        assert session.code(module) == module.code
    assert made["spliced"] > 10 * made["generated"], made


def test_a_statement_whose_code_starts_two_lines_is_not_spliced_but_a_longer_line_holding_it_is_no_match():
    """Where the old statement's code starts a line twice (two alike statements, distinct
    nodes), which one is the edited one is not known: libcst writes the text. Code occurring
    inside another line (``x = 1`` in ``max = 1``) is no place of it."""
    texts = _Texts()
    source = "x = 1\ndef f():\n    pass\nx = 1\n"
    module = cst.parse_module(source)
    texts.known(module, source)
    changed, spliced = _edit(texts, module, module.body[2], cst.parse_statement("x = 2\n"))
    assert not spliced and texts.code(changed) == changed.code == "x = 1\ndef f():\n    pass\nx = 2\n"
    source = "max = 1\nx = 1\n"
    module = cst.parse_module(source)
    texts.known(module, source)
    changed, spliced = _edit(texts, module, module.body[1], cst.parse_statement("x = 2\n"))
    assert spliced and texts.code(changed) == changed.code == "max = 1\nx = 2\n"


def test_a_spliced_text_is_known_to_parse_only_when_its_parent_is_and_its_new_statements_parse(parsed, monkeypatch):
    texts, module = parsed
    [other] = _find(module, cst.FunctionDef, lambda f: f.name.value == "other")
    changed, spliced = _edit(texts, module, other, cst.parse_statement("def other(self):\n    return 2\n"))
    assert spliced and texts.parses(module) and texts.parses(changed)
    # a text libcst generated is not vouched for, nor what is spliced from it
    [elif_] = _find(changed, cst.If, lambda node: "None" in changed.code_for_node(node.test))
    generated, spliced = _edit(texts, changed, elif_, elif_.with_changes(test=cst.parse_expression("x == 0")))
    assert not spliced and not texts.parses(generated)
    texts.code(generated)
    [other] = _find(generated, cst.FunctionDef, lambda f: f.name.value == "other")
    again, spliced = _edit(texts, generated, other, cst.parse_statement("def other(self):\n    return 3\n"))
    assert spliced and not texts.parses(again)
    # new statements that do not parse on their own (here: libcst's parser made to refuse them)
    import kiln.patch.codegen as codegen

    def refusing(code, *args, **kwargs):
        raise cst.ParserSyntaxError("refused", lines=[code], raw_line=1, raw_column=0)

    [build] = _find(module, cst.FunctionDef, lambda f: f.name.value == "build")
    monkeypatch.setattr(codegen.cst, "parse_module", refusing)
    refused, spliced = _edit(texts, module, build, cst.parse_statement("def build(self, x):\n    return x\n"))
    monkeypatch.undo()
    assert spliced and not texts.parses(refused) and texts.code(refused) == refused.code
