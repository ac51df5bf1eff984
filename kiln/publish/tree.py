"""``build.py apply --out DIR``: the whole patched ``vllm/`` tree and ``kiln-report.json``.

Public API:
    TreePublisher(path, force=False)      .check() before any work
        .stage(tree, label, result) -> Staged      ``.report``: what the report file holds

The tree is written in full beside ``DIR`` and swapped in by the same stage-and-commit helper
as every other output, so a failure leaves ``DIR`` exactly as it was. An existing ``DIR`` is
refused unless ``--force``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import KilnError
from kiln.patch.engine import RunResult
from kiln.patch.output import report
from kiln.publish import Input, Publisher
from kiln.source.tree import SourceTree
from kiln.staging import Staged, stage_dir


class TreePublisher(Publisher):
    kind = "tree"
    option = "--out"
    directory = True

    def __init__(self, path: Path, force: bool = False):
        self.path = path
        self.force = force
        self.report: dict = {}

    def check(self, inputs: Sequence[Input] = ()) -> None:
        super().check(inputs)
        if self.path.exists() and not self.force:
            raise KilnError(f"--out {self.path}: already exists (use --force to replace it)")

    def stage(self, tree: SourceTree, label: str, result: RunResult) -> Staged:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = stage_dir(self.path)
        try:
            shutil.copytree(tree.package, staged / "vllm", dirs_exist_ok=True)
            for rel, text in result.changed_text().items():
                target = staged / "vllm" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
            self.report = report(tree, label, result)
            (staged / "kiln-report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return Staged(staged, self.path)

    def where(self, image=None) -> str:
        return str(self.path)
