"""Turning a run into artefacts: unified diffs and a patched tree with its JSON report."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kiln import __version__
from kiln.errors import KilnError
from kiln.patch.engine import RunResult, sha256_text
from kiln.source.tree import SourceTree


def unified_diff(tree: SourceTree, result: RunResult) -> str:
    chunks = []
    for rel, text in result.changed_text().items():
        added = not tree.exists(rel)  # a file the patch adds: diffed against /dev/null, as git does
        before = "" if added else tree.read(rel)
        chunks.extend(
            difflib.unified_diff(
                before.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile="/dev/null" if added else f"a/vllm/{rel}",
                tofile=f"b/vllm/{rel}",
            )
        )
    return "".join(chunks)


def report(tree: SourceTree, label: str, result: RunResult) -> dict:
    files = {
        rel: {"before": sha256_text(tree.read(rel)) if tree.exists(rel) else None, "after": sha256_text(text)}
        for rel, text in result.changed_text().items()
    }
    return {
        "kiln_version": __version__,
        "source": label,
        "origin": tree.origin,
        "source_identity": tree.identity,
        "vllm_version": str(tree.vllm_version),
        "patches": [o.to_json() for o in result.outcomes.values()],
        "files": files,
    }


def write_tree(tree: SourceTree, label: str, result: RunResult, out: Path, force: bool) -> dict:
    """Write the full patched ``vllm/`` tree and ``kiln-report.json`` to ``out``, atomically.

    Everything is written into a temporary sibling directory first and renamed at the end, so
    a failure leaves ``out`` exactly as it was.
    """
    out = out.resolve()
    if out.exists() and not force:
        raise KilnError(f"{out}: already exists (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        shutil.copytree(tree.package, tmp / "vllm", dirs_exist_ok=True)
        for rel, text in result.changed_text().items():
            target = tmp / "vllm" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        data = report(tree, label, result)
        (tmp / "kiln-report.json").write_text(json.dumps(data, indent=2) + "\n")
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.rename(out, old / "x")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return data
