"""Inline before/after tests of a patch, LibCST's ``CodemodTest`` shape, with no wheel:

    assert_codemod('''
        class BlockTable:
            def move_row(self, src, tgt):
                ...
        ''', P14(), Verdict.APPLIES, '''
        class BlockTable:
            ...
        ''')

The source is written, dedented, as the patch's one target file of a throwaway tree (or pass a
dict of ``vllm``-relative path -> text for a patch of several files), the patch is evaluated by
the one engine path a build takes (``engine.isolated_run``, with its ``requires`` closure, which
must be given as ``requires``), and the verdict is compared; with ``text``, the patched file is
too (dedented; for a verdict that changes nothing, ``text`` must equal the source). A mismatch
is an ``AssertionError`` naming the verdict's detail or the first differing line.

Public API:
    assert_codemod(source, patch, verdict, text=None, *, requires=(), vllm="0.20.1", sm=None)
        -> Outcome
"""

from __future__ import annotations

import tempfile
import textwrap
from collections.abc import Iterable
from pathlib import Path

from packaging.version import Version

from kiln.patch.catalog import Catalogue
from kiln.patch.engine import Session, isolated_run
from kiln.patch.model import Patch
from kiln.patch.outcome import BuildTarget, Outcome, Verdict
from kiln.source.tree import SourceTree


def assert_codemod(source: str | dict[str, str], patch: Patch, verdict: Verdict, text: str | dict[str, str] | None = None,
                   *, requires: Iterable[Patch] = (), vllm: str = "0.20.1", sm: int | None = None) -> Outcome:
    files = _files(source, patch)
    with tempfile.TemporaryDirectory(prefix="kiln-codemod-") as root:
        for rel, body in files.items():
            path = Path(root) / "vllm" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body, encoding="utf-8")
        tree = SourceTree(Path(root), Version(vllm), f"inline:{patch.id}", "assert_codemod")
        patches = {p.id: p for p in (*requires, patch)}
        catalogue = Catalogue(Path(root), patches, {pid: pid for pid in patches})
        result = isolated_run(catalogue, Session(tree), BuildTarget(Version(vllm), sm), patch.id)
        outcome = result.outcomes[patch.id]
        assert outcome.verdict is verdict, f"{patch.id}: {outcome.verdict.name}, not {verdict.name}: {outcome.detail}"
        if text is not None:
            changed = result.changed_text()
            for rel, want in _files(text, patch).items():
                _same_text(patch.id, rel, changed.get(rel, files.get(rel, "")), want)
    return outcome


def _files(given: str | dict[str, str], patch: Patch) -> dict[str, str]:
    if isinstance(given, dict):
        return {rel: textwrap.dedent(body).lstrip("\n") for rel, body in given.items()}
    targets = sorted(patch.targets)
    if len(targets) != 1:
        raise ValueError(f"{patch.id} edits {len(targets)} files ({', '.join(targets)}): give a dict of path -> text")
    return {targets[0]: textwrap.dedent(given).lstrip("\n")}


def _same_text(pid: str, rel: str, got: str, want: str) -> None:
    if got == want:
        return
    got_lines, want_lines = got.splitlines(), want.splitlines()
    if got_lines == want_lines:
        raise AssertionError(f"{pid}: {rel}: the same lines, other line endings or final newline")
    line = next((i for i, (a, b) in enumerate(zip(got_lines, want_lines, strict=False)) if a != b),
                min(len(got_lines), len(want_lines)))
    have = got_lines[line] if line < len(got_lines) else "<end of file>"
    expected = want_lines[line] if line < len(want_lines) else "<end of file>"
    raise AssertionError(f"{pid}: {rel} line {line + 1}: got {have!r}, expected {expected!r}")
