"""The one path that decides verdicts and produces patched source.

``Session`` parses each target file of a pristine tree at most once and keeps the parsed
modules immutable, so every evaluation starts from the same objects. Evaluating a patch *is*
applying it to a copy of the current state: ``verify`` and ``apply`` run the same code and
differ only in whether the result is written.

Two modes:
- ``isolated`` (catalogue verify, golden diffs): each patch on pristine + its ``requires``.
- ``cumulative`` (an image's or a user's selection): patches in dependency order on one
  shared state; conflicts are verdicts, and an edit that only drifts because an earlier patch
  touched the same code is reported as ``CONFLICT`` with that patch named.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import libcst as cst

from kiln.errors import KilnError
from kiln.oci.digest import sha256_text
from kiln.patch.anchor import line_of, reach, resolve, symbol_of
from kiln.patch.catalog import Catalogue
from kiln.patch.model import Codemod, NewFile, Patch
from kiln.patch.outcome import BuildTarget, Outcome, Verdict
from kiln.patch.splice import replace_node
from kiln.source.tree import SourceTree


class _ParsedTexts:
    """Parsed modules by their text's sha256, shared by every ``Session`` of this process.

    Parsing is most of what a patch run costs (libcst builds ~55 bytes of tree per byte of
    source; vLLM's 7,000-line files take seconds each), and one process often patches the same
    files again: ``verify --image`` over its pins, a build's SMs and platforms, the test suite's
    many runs on the same pins (one worker parsed 81 distinct texts 488 times). A libcst tree is
    immutable, so handing the same one to two sessions is safe. Bounded by the source text held
    (``max_text`` characters, least recently used out first): the trees are ~55x that in memory.
    """

    def __init__(self, max_text: int = 8 << 20):
        self.max_text = max_text
        self._trees: OrderedDict[str, tuple[cst.Module, int]] = OrderedDict()
        self._held = 0
        self._reparsed: OrderedDict[str, None] = OrderedDict()  # texts seen to parse (no tree kept)

    def parse(self, text: str) -> cst.Module:
        """``cst.parse_module(text)``, once per text while it is held (ParserSyntaxError as libcst's)."""
        key = sha256_text(text)
        hit = self._trees.get(key)
        if hit is not None:
            self._trees.move_to_end(key)
            return hit[0]
        module = cst.parse_module(text)
        if len(text) <= self.max_text:
            self._trees[key] = (module, len(text))
            self._held += len(text)
            while self._held > self.max_text:
                self._held -= self._trees.popitem(last=False)[1][1]
        self._remember(key)
        return module

    def check_parses(self, text: str) -> None:
        """Raise libcst's ParserSyntaxError where ``text`` does not parse; a text seen to parse is not parsed again."""
        key = sha256_text(text)
        if key in self._reparsed:  # every text parse() parsed is remembered there too
            return
        cst.parse_module(text)
        self._remember(key)

    def _remember(self, key: str) -> None:
        self._reparsed[key] = None
        while len(self._reparsed) > 4096:
            self._reparsed.popitem(last=False)


PARSED = _ParsedTexts()


class Session:
    """Parsed pristine modules of one source tree (each file parsed at most once)."""

    def __init__(self, tree: SourceTree):
        self.tree = tree
        self._modules: dict[str, cst.Module | None] = {}
        self._code: dict[int, tuple[cst.Module, str]] = {}

    def code(self, module: cst.Module) -> str:
        """``module.code``, generated once per module object (codegen of big files is slow)."""
        hit = self._code.get(id(module))
        if hit is None or hit[0] is not module:
            hit = self._code[id(module)] = (module, module.code)
            while len(self._code) > 32:  # bounded: each entry keeps a parsed module alive
                self._code.pop(next(iter(self._code)))
        return hit[1]

    def module(self, rel: str) -> cst.Module | None:
        if rel not in self._modules:
            if not self.tree.exists(rel):
                self._modules[rel] = None
            else:
                try:
                    self._modules[rel] = PARSED.parse(self.tree.read(rel))
                except cst.ParserSyntaxError as err:
                    raise KilnError(f"{self.tree.file(rel)}: libcst cannot parse it: {err.message}") from None
        return self._modules[rel]

    def overlay(self, modules: dict[str, cst.Module]) -> Session:
        """A session over the same tree where ``modules`` replace the pristine files.

        Used to re-run patches on their own output (idempotence: the verdict must then be
        ``ALREADY_PATCHED`` and nothing may change).
        """
        other = Session(self.tree)
        other._modules = {**self._modules, **modules}
        other._code = dict(self._code)
        return other

    def where_is(self, symbol: str) -> list[str]:
        """Files (and lines) defining ``symbol`` elsewhere in the tree: a hint for TARGET_GONE."""
        hits = []
        needles = (f"def {symbol}(", f"class {symbol}(", f"class {symbol}:")
        for rel in self.tree.python_files():
            text = self.tree.read(rel)
            if not any(n in text for n in needles):
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if any(line.lstrip().startswith(n) for n in needles):
                    hits.append(f"{rel}:{number}")
        return hits


@dataclass
class State:
    """The current modules of a run: pristine unless a patch changed them."""

    session: Session
    changed: dict[str, cst.Module] = field(default_factory=dict)
    touched_by: dict[str, list[str]] = field(default_factory=dict)  # rel -> patch ids

    def module(self, rel: str) -> cst.Module | None:
        if rel in self.changed:
            return self.changed[rel]
        return self.session.module(rel)

    def text(self, rel: str) -> str:
        """Current source text of ``rel`` (pristine files are read, not regenerated)."""
        if rel in self.changed:
            return self.session.code(self.changed[rel])
        return self.session.tree.read(rel)

    def fork(self) -> State:
        return State(self.session, dict(self.changed), {k: list(v) for k, v in self.touched_by.items()})


@dataclass
class RunResult:
    outcomes: dict[str, Outcome]
    state: State

    def changed_text(self) -> dict[str, str]:
        return {rel: self.state.session.code(mod) for rel, mod in sorted(self.state.changed.items())}


def _evaluate_edits(patch: Patch, state: State) -> tuple[Outcome, dict[str, cst.Module]]:
    """Dry-run every edit of ``patch`` on ``state``; return the verdict and the new modules."""
    session = state.session
    working: dict[str, cst.Module] = {}
    statuses: list[tuple[type[Codemod], str, str]] = []  # (edit, status, detail)
    for edit_cls in patch.edits:
        edit = edit_cls()
        module = working.get(edit.target) or state.module(edit.target)
        if isinstance(edit, NewFile):
            statuses.append(_add_file(patch, edit, module, working))
            continue
        if module is None:
            symbol = symbol_of(edit.anchor)
            hint = ""
            if symbol:
                places = session.where_is(symbol)
                hint = f"; {symbol} is now in {', '.join(places[:3])}" if places else f"; {symbol} not found anywhere"
            return Outcome(patch.id, Verdict.TARGET_GONE, f"{edit.target} does not exist{hint}"), {}
        statuses.append(_apply_edit(patch, edit, module, working, session.module(edit.target)))

    kinds = {status for _, status, _ in statuses}
    if kinds == {"patched"}:
        return Outcome(patch.id, Verdict.ALREADY_PATCHED, "patched shape already present"), {}
    if kinds == {"upstream"}:
        return Outcome(patch.id, Verdict.UPSTREAM, "; ".join(d for _, _, d in statuses)), {}
    if kinds == {"applies"}:
        return Outcome(patch.id, Verdict.APPLIES), working
    details = [f"{e.name()}: {d}" if s == "drifted" else d or f"{e.name()}: {s}" for e, s, d in statuses if s != "applies"]
    if "drifted" not in kinds:
        details.insert(0, "edits disagree (" + ", ".join(sorted(kinds)) + ")")
    return Outcome(patch.id, Verdict.DRIFTED, "; ".join(details)), {}


def _line(node: cst.CSTNode, *modules: cst.Module | None) -> int | None:
    """The line of ``node`` in the first of ``modules`` that holds it.

    Reports give lines of the pristine file: an edit may run on a module an earlier edit of
    the same patch already changed, but the nodes it did not touch are the pristine objects.
    """
    for module in modules:
        if module is None:
            continue
        try:
            line = line_of(module, node)
        except Exception:  # a report must not fail where the codemod did
            line = None
        if line:
            return line
    return None


def _upstream_place(edit: Codemod, module: cst.Module, pristine: cst.Module | None) -> str:
    nodes = reach(module, edit.upstream) if edit.upstream else []
    line = _line(nodes[0], pristine, module) if nodes else None
    return f"{edit.target}:{line}" if line else edit.target


def _raised(stage: str, err: Exception, target: str, node: cst.CSTNode | None, *modules) -> str:
    """A codemod that raised on this source: what it was doing, why, and where (file:line)."""
    line = _line(node, *modules) if node is not None else None
    where = f"{target}:{line}" if line else target
    reason = str(err).strip().splitlines()[0] if str(err).strip() else "(no message)"
    return f"{where}: {stage} raised {err.__class__.__name__}: {reason}"


def _apply_edit(
    patch: Patch, edit: Codemod, module: cst.Module, working: dict[str, cst.Module], pristine: cst.Module | None
):
    """One codemod's status on ``module``; when it applies, its result goes into ``working``.

    A codemod is written against the shape of the code it was made for. On a source whose
    shape moved, its matchers or its rewrite may raise (a structure check in ``rewrite``, a
    matcher predicate meeting an unexpected node): that is drift of this patch on this source,
    reported with the stage, the reason and the place, never a crash of the whole run. Only a
    ``KilnError`` (bad input, a codemod that cannot see its own result) stops the run.
    """
    name = edit.name()
    stage, node = "`patched` matcher", None
    try:
        if edit.is_patched(module):
            return type(edit), "patched", ""
        stage = "`upstream` matcher"
        if edit.is_upstream(module):
            return type(edit), "upstream", f"{name}: upstream shape present in {_upstream_place(edit, module, pristine)}"
        stage = "anchor"
        found = resolve(module, edit.anchor)
        node = found.unique
        if node is None:
            return type(edit), "drifted", f"{edit.target}: {found.explain()}"
        stage = "rewrite"
        new_module = replace_node(module, node, edit.rewrite(node), found.scope)
        stage = "`patched` matcher on the result"
        sees_result = edit.is_patched(new_module)
    except KilnError:
        raise
    except Exception as err:
        return type(edit), "drifted", _raised(stage, err, edit.target, node, pristine, module)
    if not sees_result:
        raise KilnError(f"patch {patch.id}: codemod {name} ran but its `patched` matcher does not find the result")
    working[edit.target] = new_module
    return type(edit), "applies", ""


def _add_file(patch: Patch, edit: NewFile, module: cst.Module | None, working: dict[str, cst.Module]):
    """A ``NewFile``'s status: it applies where the file is absent (its anchor is the absence).

    A file already there is this patch's (marker found: re-run), vLLM's own (``upstream``), or
    someone else's at the same path, which the patch must not overwrite: drift.
    """
    name = type(edit).__name__
    if module is not None:
        try:
            if edit.is_patched(module):
                return type(edit), "patched", ""
            if edit.is_upstream(module):
                return type(edit), "upstream", f"{name}: upstream shape present in {_upstream_place(edit, module, module)}"
        except Exception as err:
            return type(edit), "drifted", _raised("matcher", err, edit.target, None)
        return type(edit), "drifted", f"{edit.target} already exists and is not this patch's file"
    try:
        new_module = cst.parse_module(edit.text(patch))
    except OSError as err:
        raise KilnError(f"patch {patch.id}: {name}.content {edit.content!r} cannot be read: {err.strerror}") from None
    except cst.ParserSyntaxError as err:
        raise KilnError(f"patch {patch.id}: {name}.content {edit.content!r} does not parse: {err.message}") from None
    if not edit.is_patched(new_module):
        raise KilnError(f"patch {patch.id}: {name}'s `patched` matcher does not find its marker in {edit.content}")
    working[edit.target] = new_module
    return type(edit), "applies", ""


def _check_compiles(patch: Patch, session: Session, modules: dict[str, cst.Module]) -> None:
    for rel, module in modules.items():
        code = session.code(module)
        try:
            compile(code, f"vllm/{rel}", "exec", dont_inherit=True)
        except SyntaxError as err:
            raise KilnError(f"patch {patch.id}: output of {rel} does not compile: {err.msg} (line {err.lineno})") from None


def evaluate(patch: Patch, state: State, target: BuildTarget, verdicts: dict[str, Outcome]) -> Outcome:
    """Decide ``patch``'s verdict on ``state`` and, when it applies, commit its edits to it."""
    outside = patch.outside_range(target.vllm_version)
    if outside:
        return Outcome(patch.id, Verdict.OUT_OF_RANGE, outside)
    gate = patch.gates.blocks(target)
    if gate:
        return Outcome(patch.id, Verdict.GATED, gate)
    for dep in patch.requires:
        dep_outcome = verdicts.get(dep)
        if dep_outcome is None or not dep_outcome.verdict.ok:
            shown = dep_outcome.verdict if dep_outcome else "not selected"
            return Outcome(patch.id, Verdict.GATED, f"requires {dep}, which is {shown}")
    try:
        upstream = patch.upstream_fix(state.module)
    except KilnError:
        raise
    except Exception as err:  # a recogniser written for other shapes: drift, not a crash
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "(no message)"
        return Outcome(patch.id, Verdict.DRIFTED, f"upstream_fix raised {err.__class__.__name__}: {reason}")
    if upstream:
        return Outcome(patch.id, Verdict.UPSTREAM, upstream)
    outcome, modules = _evaluate_edits(patch, state)
    if outcome.verdict is Verdict.APPLIES:
        _check_compiles(patch, state.session, modules)
        outcome.files = {}
        for rel, module in modules.items():
            before = sha256_text(state.text(rel)) if state.module(rel) is not None else None
            outcome.files[rel] = (before, sha256_text(state.session.code(module)))
            state.changed[rel] = module
            state.touched_by.setdefault(rel, []).append(patch.id)
    return outcome


def run_isolated(
    catalogue: Catalogue, session: Session, target: BuildTarget, ids: list[str], memo=None
) -> dict[str, Outcome]:
    """Catalogue mode: each patch on pristine + its requires closure, independently.

    ``memo`` (a ``VerdictMemo``) skips patches whose verdict on exactly these inputs is known.
    """
    outcomes: dict[str, Outcome] = {}
    for pid in ids:
        key = memo.key(session.tree, catalogue, pid, target) if memo else None
        cached = memo.get(key) if memo else None
        if cached is not None:
            outcomes[pid] = cached
            continue
        outcomes[pid] = isolated_run(catalogue, session, target, pid).outcomes[pid]
        if memo:
            memo.put(key, outcomes[pid])
    return outcomes


def isolated_run(catalogue: Catalogue, session: Session, target: BuildTarget, patch_id: str) -> RunResult:
    """Apply ``patch_id``'s requires closure cumulatively, then the patch itself."""
    state = State(session)
    outcomes: dict[str, Outcome] = {}
    chain = catalogue.closure([patch_id])
    for pid in chain:
        outcomes[pid] = evaluate(catalogue.get(pid), state, target, outcomes)
    return RunResult(outcomes, state)


def run_selection(catalogue: Catalogue, session: Session, target: BuildTarget, ids: list[str]) -> RunResult:
    """Cumulative mode: the selection (plus requires) applied in dependency order on one state."""
    order = catalogue.closure(ids)
    selected = set(order)
    outcomes: dict[str, Outcome] = {}
    state = State(session)
    # conflicts are symmetric: declared on either side, they block both
    conflicted: dict[str, set[str]] = {pid: set() for pid in order}
    for pid in order:
        for other in catalogue.get(pid).conflicts:
            if other in selected:
                conflicted[pid].add(other)
                conflicted[other].add(pid)
    for pid in order:
        patch = catalogue.get(pid)
        if conflicted.get(pid):
            outcomes[pid] = Outcome(pid, Verdict.CONFLICT, f"conflicts with {', '.join(sorted(conflicted[pid]))} (select one)")
            continue
        before = state.fork()
        outcome = evaluate(patch, state, target, outcomes)
        if outcome.verdict is Verdict.DRIFTED and any(before.touched_by.get(t) for t in patch.targets):
            alone = isolated_run(catalogue, session, target, pid).outcomes[pid]
            if alone.verdict.ok:
                culprits = sorted({p for t in patch.targets for p in before.touched_by.get(t, [])})
                outcome = Outcome(pid, Verdict.CONFLICT, f"applies alone but not after {', '.join(culprits)}: {outcome.detail}")
        outcomes[pid] = outcome
    _check_reparses(state)
    return RunResult(outcomes, state)


def _check_reparses(state: State) -> None:
    """What a selection writes must parse back to the same code (each patch already compiled)."""
    for rel, module in state.changed.items():
        code = state.session.code(module)
        try:
            # (no codegen of the result to compare: libcst's parse reproduces its input exactly)
            PARSED.check_parses(code)
        except cst.ParserSyntaxError as err:
            culprits = ", ".join(state.touched_by.get(rel, []))
            raise KilnError(f"patched {rel} (by {culprits}) does not re-parse: {err.message}") from None
