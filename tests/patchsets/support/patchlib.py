"""Helpers for patch tests: run one patch on a real tree, and pull code out of the result.

Behaviour tests execute the *patched* vLLM code. Where importing the real vLLM module on CPU
is impractical (it needs torch, triton and CUDA extensions), a test extracts the patched
function or class from the patched file with libcst and executes it against small stand-ins;
each test says which of the two it does.
"""

from __future__ import annotations

import textwrap

import libcst as cst
from packaging.version import Version

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict


def patched_files(catalogue, session, patch_id: str, version: str | None = None) -> dict[str, str]:
    """rel path -> patched text, for ``patch_id`` (with its requires) on ``session``'s tree."""
    target = BuildTarget(Version(version) if version else session.tree.vllm_version)
    result = isolated_run(catalogue, session, target, patch_id)
    outcome = result.outcomes[patch_id]
    assert outcome.verdict.ok, f"{patch_id}: {outcome.verdict} {outcome.detail}"
    return result.changed_text()


def assert_applies_once(catalogue, session, patch_id: str, version: str | None = None) -> None:
    """``patch_id`` (with its requires) APPLIES to ``session``'s tree and, run again on the tree it
    wrote, is ALREADY_PATCHED: a patch never applies twice."""
    target = BuildTarget(Version(version) if version else session.tree.vllm_version)
    first = isolated_run(catalogue, session, target, patch_id)
    outcome = first.outcomes[patch_id]
    assert outcome.verdict is Verdict.APPLIES, f"{patch_id}: {outcome.verdict} {outcome.detail}"
    again = isolated_run(catalogue, session.overlay(first.state.changed), target, patch_id).outcomes[patch_id]
    assert again.verdict is Verdict.ALREADY_PATCHED, f"{patch_id} again: {again.verdict} {again.detail}"



def assert_upstream(catalogue, session, patch_id: str) -> str:
    """``patch_id``'s verdict on ``session``'s tree is UPSTREAM; its detail (where upstream fixed it)."""
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), patch_id).outcomes[patch_id]
    assert outcome.verdict is Verdict.UPSTREAM, f"{patch_id}: {outcome.verdict} {outcome.detail}"
    return outcome.detail

def _find(module: cst.Module, path: list[str]) -> cst.CSTNode:
    body = module.body
    node = None
    for name in path:
        matches = [
            n for n in body if isinstance(n, (cst.ClassDef, cst.FunctionDef)) and n.name.value == name
        ]
        assert len(matches) == 1, f"{name}: {len(matches)} definitions"
        node = matches[0]
        body = node.body.body
    return node


def extract(source: str, dotted: str) -> str:
    """Source of a top-level def/class, or a method (``Class.method``), dedented."""
    return extract_all(source, [dotted])[dotted]


def extract_all(source: str, dotted_names: list[str]) -> dict[str, str]:
    """``extract`` for several names, parsing ``source`` once (large files parse slowly)."""
    module = cst.parse_module(source)
    return {dotted: textwrap.dedent(module.code_for_node(_find(module, dotted.split(".")))) for dotted in dotted_names}


def _overload(node: cst.FunctionDef) -> bool:
    return any(isinstance(d.decorator, cst.Name) and d.decorator.value == "overload"
               or isinstance(d.decorator, cst.Attribute) and d.decorator.attr.value == "overload"
               for d in node.decorators)


def run_defs(source: str, names: list[str], namespace: dict, rel: str, optional: tuple[str, ...] = ()) -> dict:
    """``namespace`` (the module's other globals: stand-ins) with the top-level functions ``names``
    of ``source`` (vLLM's ``rel``) defined in it by running their own code, decorators included,
    as the module does (``from __future__ import annotations``; ``vllm/<rel>`` in tracebacks). A
    function's ``@overload`` stubs are passed over for its definition. A name in ``optional`` that
    ``source`` does not define is left out of ``namespace`` (``name in namespace`` says whether it was
    there: a patch's helper); any other must be defined exactly once."""
    module = cst.parse_module(source)
    found: dict[str, list[str]] = {name: [] for name in names}
    for node in module.body:
        if isinstance(node, cst.FunctionDef) and node.name.value in found and not _overload(node):
            found[node.name.value].append(module.code_for_node(node))
    for name in names:
        codes = found[name]
        assert len(codes) == 1 or (not codes and name in optional), f"vllm/{rel}: {len(codes)} definitions of {name}"
        for code in codes:
            exec(compile("from __future__ import annotations\n" + code, f"vllm/{rel}", "exec"), namespace)
    return namespace
