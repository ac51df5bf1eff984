"""The reviewed record of expected verdicts: ``patchsets/verdicts.toml``.

One table per source label (a pin name such as ``v0.20.1``, or ``vllm-0.33.0`` for an
unpinned candidate release), one ``PATCH = "VERDICT"`` line per patch. ``verify`` compares
against it and fails on any difference; ``verify --accept`` rewrites one table (tomlkit keeps
the file's comments and the order of the other tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomlkit

from kiln.errors import KilnError
from kiln.patch.catalog import current_id, patch_sort_key
from kiln.patch.outcome import Outcome, Verdict
from kiln.staging import write_atomic

HEADER = (
    "Expected verdict of every patch on every pin (and candidate release). Reviewed in PRs.\n"
    "Rewritten per source by `python build.py verify --pin P --accept` (or `--vllm X --accept`)."
)


@dataclass
class Difference:
    patch_id: str
    expected: str  # "" when not recorded
    actual: str  # "" when the patch is no longer in the catalogue


def load_record(path: Path) -> dict[str, dict[str, str]]:
    if not path.exists():
        return {}
    try:
        doc = tomlkit.parse(path.read_text())
    except Exception as err:
        raise KilnError(f"{path}: not valid TOML: {err}") from None
    record: dict[str, dict[str, str]] = {}
    for label, table in doc.items():
        if not isinstance(table, dict):
            raise KilnError(f"{path}: {label}: must be a table of PATCH = \"VERDICT\"")
        record[label] = {}
        named: dict[str, str] = {}  # current id -> the id the file used
        for pid, verdict in table.items():
            if str(verdict) not in Verdict.__members__:
                raise KilnError(f"{path}: {label}.{pid}: {verdict!r} is not a verdict ({', '.join(Verdict)})")
            now = current_id(pid)  # a record written before a rename reads under the new id
            if now in named:
                raise KilnError(f"{path}: {label}: {named[now]} and {pid} are the same patch (renamed); keep {now}")
            named[now] = pid
            record[label][now] = str(verdict)
    return record


def compare(expected: dict[str, str], outcomes: dict[str, Outcome]) -> list[Difference]:
    diffs = []
    for pid in sorted(set(expected) | set(outcomes), key=patch_sort_key):
        want = expected.get(pid, "")
        got = str(outcomes[pid].verdict) if pid in outcomes else ""
        if want != got:
            diffs.append(Difference(pid, want, got))
    return diffs


def accept(path: Path, label: str, outcomes: dict[str, Outcome]) -> None:
    write_atomic(path, accepted_text(path, label, outcomes).encode())


def accepted_text(path: Path, label: str, outcomes: dict[str, Outcome], drop: tuple[str, ...] = ()) -> str:
    """The record's new text: ``label``'s table set to ``outcomes``, the ``drop`` tables removed.

    Returned rather than written so a caller changing several files (``pin bump``) can stage
    them all and commit together.
    """
    doc = tomlkit.parse(path.read_text()) if path.exists() else tomlkit.document()
    if not path.exists():
        for line in HEADER.splitlines():
            doc.add(tomlkit.comment(line))
        doc.add(tomlkit.nl())
    table = tomlkit.table()
    for pid in sorted(outcomes, key=patch_sort_key):
        table.add(pid, str(outcomes[pid].verdict))
    if label in doc:
        doc[label] = table
    else:
        doc.add(label, table)
    for gone in drop:
        if gone in doc and gone != label:
            del doc[gone]
    return tomlkit.dumps(doc)


def verdict_counts(table: dict[str, str] | None) -> dict[str, int] | None:
    """``{"APPLIES": 9, "UPSTREAM": 3}`` from a source's table in the record (None: none)."""
    if table is None:
        return None
    counts: dict[str, int] = {}
    for verdict in table.values():
        counts[verdict] = counts.get(verdict, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
