"""Memoised verdicts: a verdict is a pure function of its inputs, so it is cached by them.

Key = the source tree's content address + the sha256 of the patch module and of every module
it requires + the sha256 of the engine's own code and the libcst version + the build target.
Change any input and the verdict is recomputed; nothing else can make it stale. Only verdicts
are memoised (``verify``); ``diff``/``apply``/``build`` always run the codemods.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from importlib.metadata import version
from pathlib import Path

from kiln.cache import cache_root
from kiln.patch.catalog import Catalogue
from kiln.patch.model import BuildTarget, Outcome, Verdict
from kiln.source.tree import SourceTree
from kiln.staging import write_atomic

_ENGINE_FILES = ("anchor.py", "catalog.py", "engine.py", "model.py", "shapes.py")


@cache
def engine_digest() -> str:
    h = hashlib.sha256(f"libcst {version('libcst')}\n".encode())
    here = Path(__file__).parent
    for name in _ENGINE_FILES:
        h.update((here / name).read_bytes())
    return h.hexdigest()


class VerdictMemo:
    def __init__(self, root: Path | None = None):
        self._root = root

    @property
    def root(self) -> Path:
        """``<cache>/verdicts``, the cache claimed on first use (not when the memo is made)."""
        return (self._root or cache_root()) / "verdicts"

    def key(self, tree: SourceTree, catalogue: Catalogue, patch_id: str, target: BuildTarget) -> str:
        parts = [tree.identity, engine_digest(), catalogue.digest_with_requires(patch_id), repr(target)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def get(self, key: str) -> Outcome | None:
        path = self.root / key[:2] / f"{key}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        files = {rel: (v["before"], v["after"]) for rel, v in data.get("files", {}).items()} or None
        return Outcome(data["patch"], Verdict(data["verdict"]), data.get("detail", ""), files)

    def put(self, key: str, outcome: Outcome) -> None:
        write_atomic(self.root / key[:2] / f"{key}.json", json.dumps(outcome.to_json()).encode())
