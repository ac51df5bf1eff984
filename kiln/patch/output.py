"""What a run changed, as text: unified diffs and the JSON report (``apply`` writes it with the tree)."""

from __future__ import annotations

import difflib

from kiln import __version__
from kiln.oci.digest import sha256_text
from kiln.patch.engine import RunResult
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
