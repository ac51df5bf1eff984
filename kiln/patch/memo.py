"""Memoised patch results: a verdict, and a selection's patched files, are pure functions of
their inputs, so they are cached by them.

Public API:
    VerdictMemo(root=None)       one patch's verdict (``verify``, ``pin bump``, the train)
    SelectionMemo(root=None)     a whole selection's outcomes and patched files (``build``)
    patched_selection(catalogue, tree, target, ids, memo=None) -> PatchedSelection
    engine_digest()              the engine's code + libcst version, part of every key

Key = the source tree's content address + the sha256 of each patch module (and of everything
it requires) + the engine's own code and the libcst version + the build target (+ for a
selection, the patch ids asked for). Change any input and the result is recomputed; nothing
else can make it stale. ``diff`` and ``apply`` always run the codemods; a build reuses a
selection it has patched before (a warm rebuild with nothing changed skips the patching).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from pathlib import Path

from kiln.cache import cache_root
from kiln.patch.catalog import Catalogue
from kiln.patch.engine import Session, run_selection
from kiln.patch.model import BuildTarget, Outcome, Verdict
from kiln.source.tree import SourceTree
from kiln.staging import write_atomic

_ENGINE_FILES = ("anchor.py", "catalog.py", "engine.py", "model.py", "shapes.py", "splice.py")


@cache
def engine_digest() -> str:
    h = hashlib.sha256(f"libcst {version('libcst')}\n".encode())
    here = Path(__file__).parent
    for name in _ENGINE_FILES:
        h.update((here / name).read_bytes())
    return h.hexdigest()


def _outcome(data: dict) -> Outcome:
    files = {rel: (v["before"], v["after"]) for rel, v in data.get("files", {}).items()} or None
    return Outcome(data["patch"], Verdict(data["verdict"]), data.get("detail", ""), files)


class _JsonMemo:
    kind = ""

    def __init__(self, root: Path | None = None):
        self.root = (root or cache_root()) / self.kind

    def _read(self, key: str) -> dict | None:
        try:
            return json.loads((self.root / key[:2] / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None

    def _write(self, key: str, data: dict) -> None:
        write_atomic(self.root / key[:2] / f"{key}.json", json.dumps(data).encode())


class VerdictMemo(_JsonMemo):
    kind = "verdicts"

    def key(self, tree: SourceTree, catalogue: Catalogue, patch_id: str, target: BuildTarget) -> str:
        parts = [tree.identity, engine_digest(), catalogue.digest_with_requires(patch_id), repr(target)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def get(self, key: str) -> Outcome | None:
        data = self._read(key)
        return _outcome(data) if data else None

    def put(self, key: str, outcome: Outcome) -> None:
        self._write(key, outcome.to_json())


@dataclass(frozen=True)
class PatchedSelection:
    """What a build needs of ``run_selection``: every outcome, and the text of each changed file."""

    outcomes: dict[str, Outcome]
    changed: dict[str, str]  # vllm-relative path -> patched text, sorted
    memoised: bool = False

    def changed_text(self) -> dict[str, str]:
        return dict(self.changed)


class SelectionMemo(_JsonMemo):
    kind = "selections"

    def key(self, tree: SourceTree, catalogue: Catalogue, target: BuildTarget, ids: list[str]) -> str:
        modules = [f"{pid}:{catalogue.digests[pid]}" for pid in catalogue.closure(ids)]
        parts = [tree.identity, engine_digest(), repr(target), ",".join(ids), *modules]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def get(self, key: str) -> PatchedSelection | None:
        data = self._read(key)
        if not data:
            return None
        outcomes = {o["patch"]: _outcome(o) for o in data["outcomes"]}
        return PatchedSelection(outcomes, dict(sorted(data["changed"].items())), memoised=True)

    def put(self, key: str, selection: PatchedSelection) -> None:
        self._write(key, {"outcomes": [o.to_json() for o in selection.outcomes.values()],
                          "changed": selection.changed})


def patched_selection(catalogue: Catalogue, tree: SourceTree, target: BuildTarget, ids: list[str],
                      memo: SelectionMemo | None = None) -> PatchedSelection:
    """``run_selection`` on ``tree``, or its remembered result for exactly these inputs."""
    key = memo.key(tree, catalogue, target, ids) if memo else ""
    found = memo.get(key) if memo else None
    if found is not None:
        return found
    result = run_selection(catalogue, Session(tree), target, ids)
    selection = PatchedSelection(dict(result.outcomes), result.changed_text())
    if memo:
        memo.put(key, selection)
    return selection
