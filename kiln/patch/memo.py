"""Memoised patch results: a verdict, and a selection's patched files, are pure functions of
their inputs, so they are cached by them.

Public API:
    VerdictMemo(root=None)       one patch's verdict (``verify``, ``pin bump``, the train)
    SelectionMemo(root=None)     a selection's outcomes and patched files, per independent group
    independent_groups(catalogue, order) -> list[list[str]]
    patched_selection(catalogue, tree, target, ids, memo=None, jobs=None, forked=None, first=None)
        -> PatchedSelection
    engine_digest()              the engine's code + libcst version, part of every key

Key = the source tree's content address + the sha256 of each patch module (and of everything
it requires) + the engine's own code and the libcst version + the build target (+ for a
selection, the patch ids asked for). Change any input and the result is recomputed; nothing
else can make it stale. ``diff`` and ``apply`` always run the codemods; a build reuses what it
has patched before, per independent group of patches (``SelectionMemo``): a rebuild with
nothing changed patches nothing, one with a patch module edited re-runs that patch's group.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from pathlib import Path

from kiln.cache import cache_root
from kiln.jobs import worker_count
from kiln.lifeline import child_of, uninterrupted
from kiln.patch.catalog import Catalogue
from kiln.patch.engine import Session, run_selection
from kiln.patch.outcome import BuildTarget, Outcome, Verdict
from kiln.pausepoint import pause_point
from kiln.source.tree import SourceTree
from kiln.staging import write_atomic

_ENGINE_FILES = ("anchor.py", "catalog.py", "codegen.py", "engine.py", "model.py", "shapes.py", "splice.py")


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
        self._root = root

    @property
    def root(self) -> Path:
        """``<cache>/<kind>``, the cache claimed on first use (not when the memo is made)."""
        return (self._root or cache_root()) / self.kind

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
    patched: tuple[str, ...] = ()  # the patches this call ran (the rest came from the memo)

    def changed_text(self) -> dict[str, str]:
        return dict(self.changed)


@dataclass(frozen=True)
class _Group:
    """One independent group's result, and every file its patches read (to check independence)."""

    outcomes: list[Outcome]
    changed: dict[str, str]
    reads: frozenset[str]


class SelectionMemo(_JsonMemo):
    """A selection's result, remembered per *independent group* of its patches.

    Patches that share no target file, ``requires`` or ``conflicts`` edge cannot see each
    other's edits, so a group's outcomes and files depend only on its own patches: editing one
    patch module re-runs its group alone. That holds only while no group *reads* a file another
    group changes (an ``upstream_fix`` may look anywhere): every group records what it read,
    and when that rule fails ``patched_selection`` runs the whole selection instead.
    """

    kind = "selections"

    def key(self, tree: SourceTree, catalogue: Catalogue, target: BuildTarget, ids: list[str]) -> str:
        modules = [f"{pid}:{catalogue.digests[pid]}" for pid in catalogue.closure(ids)]
        parts = [tree.identity, engine_digest(), repr(target), ",".join(ids), *modules]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def get(self, key: str) -> _Group | None:
        data = self._read(key)
        if not data:
            return None
        return _Group([_outcome(o) for o in data["outcomes"]], data["changed"], frozenset(data["reads"]))

    def put(self, key: str, group: _Group) -> None:
        self._write(key, {"outcomes": [o.to_json() for o in group.outcomes], "changed": group.changed,
                          "reads": sorted(group.reads)})


class _ReadingSession(Session):
    """A Session that notes every file a run asks for."""

    def __init__(self, tree: SourceTree):
        super().__init__(tree)
        self.reads: set[str] = set()

    def module(self, rel: str):
        self.reads.add(rel)
        return super().module(rel)


def independent_groups(catalogue: Catalogue, order: list[str]) -> list[list[str]]:
    """``order`` split into groups linked by a shared target file, ``requires`` or ``conflicts``."""
    parent = {pid: pid for pid in order}

    def root(pid: str) -> str:
        while parent[pid] != pid:
            pid = parent[pid]
        return pid

    owner: dict[str, str] = {}
    for pid in order:
        patch = catalogue.get(pid)
        for other in [owner.setdefault(t, pid) for t in patch.targets] + [
                o for o in (*patch.requires, *patch.conflicts) if o in parent]:
            parent[root(pid)] = root(other)
    groups: dict[str, list[str]] = {}
    for pid in order:
        groups.setdefault(root(pid), []).append(pid)
    return list(groups.values())


def patched_selection(catalogue: Catalogue, tree: SourceTree, target: BuildTarget, ids: list[str],
                      memo: SelectionMemo | None = None, jobs: int | None = None,
                      forked: Callable[[dict[str, str]], bool | None] | None = None,
                      first: Callable[[str], bool] | None = None) -> PatchedSelection:
    """``run_selection`` on ``tree``, reusing what ``memo`` remembers for exactly these inputs.

    Groups the memo lacks run in up to ``jobs`` processes (default: ``KILN_JOBS``, else the core
    count: ``kiln.jobs``), the largest first: they share nothing, and parsing and rewriting are CPU-bound.

    ``forked`` is called once, with the patched text of the files ``first`` accepts (a build: the
    files its Triton kernels compile from), as soon as every group targeting one of them is done
    and no more processes will be forked: the caller starts work beside the rest of the patching
    then (a thread: forking a process that runs other threads can deadlock the child). Those
    groups run before the others. The text it is handed is what the selection's result holds,
    unless a group read another's output and the whole selection ran again (rare: the caller
    compares). When it returns True (work was started), the patch processes make way for that
    work (``YIELD_NICE``).
    """
    forked = forked or (lambda changed: False)
    first = first or (lambda rel: False)

    def leads(group: list[str]) -> bool:  # a group that patches a file ``first`` accepts
        return any(first(rel) for pid in group for rel in catalogue.get(pid).targets)

    def hand(results) -> bool:  # the leading groups' results: their files ``first`` accepts, to ``forked``
        return bool(forked({rel: text for group in results for rel, text in group.changed.items() if first(rel)}))

    order = catalogue.closure(ids)
    if memo is None:
        if not leads(order):
            forked({})
            return _whole(catalogue, tree, target, ids, order)
        result = _whole(catalogue, tree, target, ids, order)
        hand([result])
        return result
    groups = independent_groups(catalogue, order)
    keys = [memo.key(tree, catalogue, target, group) for group in groups]
    found = [memo.get(key) for key in keys]
    missing = [i for i, entry in enumerate(found) if entry is None]
    remembered = [entry for i, entry in enumerate(found) if entry is not None and leads(groups[i])]
    todo = [groups[i] for i in missing]
    ran = _run_groups(catalogue, tree, target, todo, jobs, [j for j, group in enumerate(todo) if leads(group)],
                      lambda done: hand(remembered + done))
    for i, entry in zip(missing, ran, strict=True):
        memo.put(keys[i], entry)
        found[i] = entry
    changed = {rel: text for group in found for rel, text in group.changed.items()}
    if any(group.reads & (changed.keys() - group.changed.keys()) for group in found):
        return _whole(catalogue, tree, target, ids, order)  # a group read another's output
    outcomes = {o.patch_id: o for group in found for o in group.outcomes}
    patched = tuple(pid for i in missing for pid in groups[i])
    return PatchedSelection({pid: outcomes[pid] for pid in order}, dict(sorted(changed.items())), patched)


_FORKED: tuple | None = None  # (catalogue, tree, target) for forked workers: patch classes do not pickle


def _run_group(group: list[str]) -> _Group:
    catalogue, tree, target = _FORKED
    pause_point("patching")
    session = _ReadingSession(tree)
    result = run_selection(catalogue, session, target, group)
    return _Group(list(result.outcomes.values()), result.changed_text(), frozenset(session.reads))


# The niceness of the patch processes while work the caller started beside them runs (a build:
# its Triton kernel compile, one chain of about 4 s of CPU on the shipped image: compile, then a
# fresh process's check). Three processes on two cores gave that chain 2/3 of a core: it ended
# after the patching, which then waited for it with a core idle. At nice 3 (CFS weight 526
# against 1024) the chain gets about a core and the patch processes the rest; the cold build of
# the shipped image went from 9.6 to 8.5 s here (docs/BENCHMARKS.md). More (nice 10) starved the
# patching instead.
YIELD_NICE = 3


def _run_groups(catalogue: Catalogue, tree: SourceTree, target: BuildTarget, groups: list[list[str]],
                jobs: int | None, leading: list[int], lead_done: Callable[[list[_Group]], bool]) -> list[_Group]:
    """Every group's result, in order; ``leading`` (indices) run first, and ``lead_done`` gets their
    results once they are done and every worker has been forked (True: the workers then yield)."""
    global _FORKED
    _FORKED = (catalogue, tree, target)
    workers = worker_count(len(groups), jobs)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        done = {i: _run_group(groups[i]) for i in leading}
        lead_done(list(done.values()))
        return [done[i] if i in done else _run_group(group) for i, group in enumerate(groups)]

    def size(group: list[str]) -> int:  # parsing dominates: the biggest files first
        files = {t for pid in group for t in catalogue.get(pid).targets}
        return sum((tree.package / rel).stat().st_size for rel in files if (tree.package / rel).is_file())

    by_size = sorted(range(len(groups)), key=lambda i: (i not in leading, -size(groups[i])))
    others = set(multiprocessing.active_children())
    # each worker dies with this process (a killed build leaves none behind: kiln.lifeline)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=child_of, initargs=(os.getpid(),))
    try:
        with uninterrupted():  # a signal inside submit could leave a worker the pool does not know
            futures = {i: pool.submit(_run_group, groups[i]) for i in by_size}
        # (with "fork", the pool starts all its workers at the first submit, before its own thread)
        if lead_done([futures[i].result() for i in leading]):
            _make_way(set(multiprocessing.active_children()) - others)
        results = [futures[i].result() for i in range(len(groups))]
    except BaseException:  # an error, or Interrupted: the running groups are not waited for
        for process in set(multiprocessing.active_children()) - others:
            process.kill()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def _make_way(workers) -> None:
    """The pool's ``workers`` lowered to ``YIELD_NICE`` (a process may lower its children's priority)."""
    for worker in workers:
        try:
            os.setpriority(os.PRIO_PROCESS, worker.pid, max(os.getpriority(os.PRIO_PROCESS, worker.pid), YIELD_NICE))
        except (ProcessLookupError, PermissionError):  # gone already; or a system that refuses: as it was
            pass


def _whole(catalogue: Catalogue, tree: SourceTree, target: BuildTarget, ids: list[str],
           order: list[str]) -> PatchedSelection:
    result = run_selection(catalogue, Session(tree), target, ids)
    return PatchedSelection(dict(result.outcomes), result.changed_text(), tuple(order))
