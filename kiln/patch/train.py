"""The release train: every patch's verdict on every vLLM release of a range.

kiln judges a fix on the exact vLLM it ships on. The train runs the catalogue in isolated mode
(as ``verify`` does, with the verdict memo) on a list of releases and returns a patch x release
matrix of ``Outcome``s, so a reviewer sees where each patch applies, where upstream took the
fix over, and where a codemod stopped fitting. The reviewed matrix is recorded in
``patchsets/release-train.toml`` (one table ``vllm-X.Y.Z`` per release, ``PATCH = "VERDICT"``,
the same format as ``verdicts.toml``, read and written by ``kiln.patch.record``).

Library code: no printing; progress goes to the ``Reporter`` passed in (one task, one item per release).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import tomlkit
from packaging.version import InvalidVersion, Version

from kiln.errors import KilnError
from kiln.patch.catalog import Catalogue, patch_sort_key
from kiln.patch.engine import Session, run_isolated
from kiln.patch.outcome import BuildTarget, Outcome
from kiln.patch.record import Difference, compare, load_record
from kiln.report import SILENT, Reporter
from kiln.source.tree import SourceProvider

TRAIN_RECORD = "release-train.toml"  # beside the catalogue (patchsets/)

HEADER = (
    "The release train: the reviewed verdict of every patch on every vLLM release it was run on.\n"
    "Rewritten by `python build.py verify --vllm FIRST..LAST --accept`; every change between\n"
    "consecutive releases is explained in the patch module's 'Verdicts across releases' and in\n"
    "docs/RELEASE_TRAIN.md."
)

_RANGE = re.compile(r"^\s*([^.\s][^\s]*?)\s*\.\.\s*([^\s]+)\s*$")


def release_label(version: Version) -> str:
    """The record's table name for a release (as ``verify --vllm X`` labels it)."""
    return f"vllm-{version}"


def is_release_range(spec: str) -> bool:
    return ".." in spec


def parse_release_range(spec: str) -> tuple[Version, Version]:
    """``"0.20.1..0.33.0"`` -> (first, last), both inclusive; a one-line error otherwise."""
    match = _RANGE.match(spec)
    if not match:
        raise KilnError(f"release range {spec!r}: expected FIRST..LAST, e.g. 0.20.1..0.33.0")
    try:
        first, last = Version(match.group(1)), Version(match.group(2))
    except InvalidVersion as err:
        raise KilnError(f"release range {spec!r}: {err}") from None
    if last < first:
        raise KilnError(f"release range {spec!r}: {last} is before {first}")
    return first, last


def releases_in(spec: str, available: Iterable[Version]) -> list[Version]:
    """The final releases of ``available`` inside the range ``spec``, oldest first.

    ``available`` is what the index offers (``kiln.source.wheel.list_releases``). An empty
    result is an error: a range that names no release is a typo, not a pass.
    """
    first, last = parse_release_range(spec)
    chosen = sorted(
        v for v in set(available) if first <= v <= last and not v.is_prerelease and not v.is_devrelease
    )
    if not chosen:
        raise KilnError(f"release range {spec!r}: no final vLLM release on the index in it")
    return chosen


@dataclass
class TrainMatrix:
    """Outcomes by release label, then by patch id (both in order)."""

    releases: list[Version]
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)  # label -> pid -> outcome
    origins: dict[str, str] = field(default_factory=dict)  # label -> where the source came from

    @property
    def labels(self) -> list[str]:
        return [release_label(v) for v in self.releases]

    @property
    def patch_ids(self) -> list[str]:
        ids: dict[str, None] = {}
        for label in self.labels:
            ids.update(dict.fromkeys(self.outcomes.get(label, {})))
        return sorted(ids, key=patch_sort_key)

    def verdict(self, patch_id: str, label: str) -> str:
        outcome = self.outcomes.get(label, {}).get(patch_id)
        return str(outcome.verdict) if outcome else ""

    def changes(self, patch_id: str) -> list[tuple[str, str, str, str]]:
        """Where ``patch_id``'s verdict flips between consecutive releases:
        (previous label, label, previous verdict, verdict)."""
        flips = []
        labels = self.labels
        for before, after in zip(labels, labels[1:], strict=False):
            old, new = self.verdict(patch_id, before), self.verdict(patch_id, after)
            if old != new:
                flips.append((before, after, old, new))
        return flips

    def to_json(self) -> dict:
        return {
            "releases": self.labels,
            "origins": self.origins,
            "patches": {
                pid: {label: self.outcomes[label][pid].to_json() for label in self.labels if pid in self.outcomes[label]}
                for pid in self.patch_ids
            },
        }


def run_train(
    catalogue: Catalogue,
    releases: Iterable[Version],
    provider: Callable[[Version], SourceProvider],
    *,
    memo=None,
    patch_ids: list[str] | None = None,
    reporter: Reporter = SILENT,
) -> TrainMatrix:
    """Every patch of ``catalogue`` (or ``patch_ids``) in isolated mode on each release.

    ``provider(version)`` gives the release's pristine source (``WheelSource`` in practice);
    ``memo`` is a ``VerdictMemo`` (or None). One release is parsed at a time, so memory stays
    that of a single ``verify``. ``reporter`` shows one task counting the releases done.
    """
    versions = sorted(set(releases))
    ids = list(patch_ids) if patch_ids is not None else list(catalogue.patches)
    matrix = TrainMatrix(versions)
    with reporter.task("release train", total=len(versions), unit="items") as task:
        for version in versions:
            label = release_label(version)
            task.update(description=f"verify {label}")
            tree = provider(version).fetch()
            outcomes = run_isolated(catalogue, Session(tree), BuildTarget(vllm_version=version), ids, memo)
            matrix.outcomes[label] = outcomes
            matrix.origins[label] = tree.origin
            task.advance(1)
    return matrix


def compare_with_record(matrix: TrainMatrix, record_path: Path) -> dict[str, list[Difference]]:
    """Per release label, the differences from the recorded train (unrecorded releases included)."""
    record = load_record(record_path)
    differences = {}
    for label in matrix.labels:
        found = compare(record.get(label, {}), matrix.outcomes[label])
        if found:
            differences[label] = found
    return differences


def accepted_train_text(record_path: Path, matrix: TrainMatrix) -> str:
    """The train record's new text: every release of ``matrix`` set to its verdicts, the
    other recorded releases kept, tables ordered by release."""
    tables = load_record(record_path)
    for label in matrix.labels:
        outcomes = matrix.outcomes[label]
        tables[label] = {pid: str(outcomes[pid].verdict) for pid in sorted(outcomes, key=patch_sort_key)}
    doc = tomlkit.document()
    for line in HEADER.splitlines():
        doc.add(tomlkit.comment(line))
    doc.add(tomlkit.nl())
    for label in sorted(tables, key=_release_order):
        table = tomlkit.table()
        for pid, verdict in tables[label].items():
            table.add(pid, verdict)
        doc.add(label, table)
    return tomlkit.dumps(doc)


def _release_order(label: str) -> tuple[int, Version | str]:
    try:
        return (0, Version(label.removeprefix("vllm-")))
    except InvalidVersion:
        return (1, label)
