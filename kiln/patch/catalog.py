"""Load the patch catalogue from ``patchsets/<family>/<patch>.py`` and validate its metadata.

Every problem is reported as one line naming the file and the field at fault, before any
source is read: a malformed catalogue never produces a verdict.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from kiln.errors import KilnError
from kiln.patch.outcome import Gates

if TYPE_CHECKING:
    from kiln.patch.model import NewFile, Patch

# The patch modules (and so libcst, 0.3 s to import) are imported by ``load_catalogue`` only: a
# build whose every part its registry cache holds takes the catalogue's facts from there
# (``kiln.patch.facts``) and never imports them.

# An id means the same fix as Genesis's (github Sandermage/genesis-vllm-patches) under that
# id: "P65", "P5b", "PN401", "PN353A" are Genesis's ids, spelt as its registry spells them. A fix
# Genesis does not have is "K<n>" (kiln's own sequence), a prefix Genesis never uses (its ids
# are P<n>, PN<n>, G4_<n>, SNDR_*), so the two can never collide.
_ID = re.compile(r"^(PN?\d+[a-zA-Z]?|K\d+)$")
_FAMILY = re.compile(r"^[a-z][a-z0-9_]*$")

# Ids that were renamed, old -> new: records, image definitions and `--patch` written before
# the rename keep working (`current_id`). P98 was Genesis's PN353A (vllm#44053); the K ids had
# P/PN ids although Genesis has no such fixes.
RENAMED = {"P98": "PN353A", "P61d": "K1", "P110": "K2", "P111": "K3", "PN401b": "K4"}


def current_id(patch_id: str) -> str:
    """The id a patch has now (``patch_id`` itself unless it was renamed)."""
    return RENAMED.get(patch_id, patch_id)


def patch_sort_key(patch_id: str) -> tuple[int, int, str]:
    """Natural order: P4 < P5 < P5b < P22 < P65 < PN399 < PN401 < K1 < K2 < K10."""
    match = re.match(r"(P|PN|K)(\d+)(.*)", patch_id)
    if not match:
        return (3, 1 << 30, patch_id)
    return ({"P": 0, "PN": 1, "K": 2}[match.group(1)], int(match.group(2)), match.group(3))


@dataclass
class Catalogue:
    root: Path
    patches: dict[str, Patch]  # id -> instance, natural order
    digests: dict[str, str]  # id -> sha256 of the patch module file

    def get(self, patch_id: str) -> Patch:
        try:
            return self.patches[current_id(patch_id)]
        except KeyError:
            raise KilnError(f"unknown patch {patch_id!r} (not in {self.root})") from None

    def default_selection(self) -> list[str]:
        """Every patch that is not a variant an image has to opt into."""
        return [pid for pid, p in self.patches.items() if not p.variant]

    def closure(self, ids: list[str]) -> list[str]:
        """``ids`` plus everything they require, in dependency order."""
        wanted: set[str] = set()

        def add(pid: str) -> None:
            pid = current_id(pid)
            if pid in wanted:
                return
            wanted.add(pid)
            for dep in self.get(pid).requires:
                add(dep)

        for pid in ids:
            add(pid)
        return self.order(wanted)

    def order(self, ids) -> list[str]:
        """Topological order by ``requires``; natural id order among independent patches."""
        ids = set(ids)
        done: list[str] = []
        placed: set[str] = set()
        visiting: set[str] = set()

        def visit(pid: str) -> None:
            if pid in placed:
                return
            if pid in visiting:
                raise KilnError(f"{self.patches[pid].source_file}: requires cycle through {pid}")
            visiting.add(pid)
            for dep in sorted(self.patches[pid].requires, key=patch_sort_key):
                if dep in ids:
                    visit(dep)
            visiting.discard(pid)
            placed.add(pid)
            done.append(pid)

        for pid in sorted(ids, key=patch_sort_key):
            visit(pid)
        return done

    def digest_with_requires(self, patch_id: str) -> str:
        """A digest of the patch module and the modules of everything it requires."""
        h = hashlib.sha256()
        for pid in self.closure([patch_id]):
            h.update(f"{pid}:{self.digests[pid]}\n".encode())
        return h.hexdigest()


def load_catalogue(root: Path) -> Catalogue:
    if not root.is_dir():
        raise KilnError(f"{root}: patchsets directory not found")
    found: dict[str, Patch] = {}
    digests: dict[str, str] = {}
    for path in sorted(root.glob("*/*.py")):
        if path.name.startswith("_") or path.parent.name.startswith(("_", ".")):
            continue
        patch = _load_module(path, root)
        if patch.id in found:
            raise KilnError(f"{path}: id {patch.id!r} already defined in {found[patch.id].source_file}")
        found[patch.id] = patch
        digests[patch.id] = _digest(path, patch)
    for patch in found.values():
        for field in ("requires", "conflicts"):
            for other in getattr(patch, field):
                if other not in found and not (field == "conflicts"):
                    raise KilnError(f"{patch.source_file}: {field} names unknown patch {other!r}")
    ordered = {pid: found[pid] for pid in sorted(found, key=patch_sort_key)}
    catalogue = Catalogue(root, ordered, digests)
    catalogue.order(ordered)  # detects requires cycles
    return catalogue


def _digest(path: Path, patch: Patch) -> str:
    """sha256 of the patch module and of the content files its ``NewFile`` edits add."""
    from kiln.patch.model import NewFile

    h = hashlib.sha256(path.read_bytes())
    for edit in patch.edits:
        if issubclass(edit, NewFile):
            h.update(f"\n{edit.content}\n".encode())
            h.update((path.parent / edit.content).read_bytes())
    return h.hexdigest()


def _load_module(path: Path, root: Path) -> Patch:
    from kiln.patch.model import Patch

    name = f"kiln_patchsets.{path.parent.name}.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise KilnError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # any failure inside a patch module is that module's fault
        sys.modules.pop(name, None)
        raise KilnError(f"{path}: patch module failed to import: {err.__class__.__name__}: {err}") from None
    classes = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, Patch) and obj is not Patch and obj.__module__ == name
    ]
    if len(classes) != 1:
        raise KilnError(f"{path}: must define exactly one Patch subclass (found {len(classes)})")
    cls = classes[0]
    cls.source_file = str(path)
    _validate(cls, path)
    return cls()


def _validate(cls: type[Patch], path: Path) -> None:
    import libcst.matchers as m

    from kiln.patch.model import Codemod, NewFile

    def fail(field: str, why: str) -> None:
        raise KilnError(f"{path}: {cls.__name__}.{field}: {why}")

    for field in ("id", "family", "title", "why"):
        value = getattr(cls, field, None)
        if not isinstance(value, str) or not value.strip():
            fail(field, "missing or not a non-empty string")
    if not _ID.match(cls.id):
        fail("id", f"{cls.id!r} is not like 'P65', 'P5b', 'PN401' (Genesis's ids) or 'K1' (kiln's own)")
    if cls.id in RENAMED:
        fail("id", f"{cls.id!r} was renamed to {RENAMED[cls.id]!r}; an old id is never reused")
    if path.stem.lower() != cls.id.lower() and not path.stem.lower().startswith(cls.id.lower() + "_"):
        fail("id", f"{cls.id!r} does not match the file name {path.name!r} (expected {cls.id.lower()}_*.py)")
    if not _FAMILY.match(cls.family) or cls.family != path.parent.name:
        fail("family", f"{cls.family!r} must equal its directory name {path.parent.name!r}")
    for field in ("upstream_refs", "requires", "conflicts"):
        value = getattr(cls, field)
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            fail(field, "must be a tuple of non-empty strings")
    if cls.id in cls.requires or cls.id in cls.conflicts:
        fail("requires", "a patch cannot require or conflict with itself")
    if set(cls.requires) & set(cls.conflicts):
        fail("conflicts", f"{sorted(set(cls.requires) & set(cls.conflicts))[0]} is both required and conflicting")
    if not isinstance(cls.gates, Gates):
        fail("gates", "must be a Gates(...)")
    try:
        cls.gates.specifier()
    except ValueError as err:
        fail("gates", str(err))
    if not isinstance(cls.written_for, str):
        fail("written_for", "must be a version specifier string such as '>=0.20.1'")
    try:
        SpecifierSet(cls.written_for)
    except InvalidSpecifier:
        fail("written_for", f"{cls.written_for!r} is not a version specifier")
    for field in ("perf_critical", "variant"):
        if not isinstance(getattr(cls, field), bool):
            fail(field, "must be True or False")
    edits = getattr(cls, "edits", None)
    if not isinstance(edits, tuple) or not edits:
        fail("edits", "must be a non-empty tuple of Codemod classes")
    for edit in edits:
        if not (isinstance(edit, type) and issubclass(edit, Codemod)):
            fail("edits", f"{edit!r} is not a Codemod subclass")
        where = f"edits[{edit.__name__}]"
        target = getattr(edit, "target", None)
        if not isinstance(target, str) or not target.endswith(".py") or target.startswith(("/", "vllm/")) or ".." in target:
            fail(where + ".target", f"{target!r} must be a .py path relative to the vllm package")
        if issubclass(edit, NewFile):
            _validate_new_file(edit, path, fail, where)
            continue
        for attr, required in (("anchor", True), ("patched", True), ("upstream", False)):
            value = getattr(edit, attr, None)
            if value is None and not required:
                continue
            if not isinstance(value, tuple) or not value or not all(isinstance(x, m.BaseMatcherNode) for x in value):
                fail(f"{where}.{attr}", "must be a non-empty tuple of libcst matchers")
        if edit.rewrite is Codemod.rewrite:
            fail(f"{where}.rewrite", "not implemented")


def _validate_new_file(edit: type[NewFile], path: Path, fail, where: str) -> None:
    """A ``NewFile``: its content file lies beside the patch module; it has no anchor or rewrite."""
    import libcst.matchers as m

    from kiln.patch.model import Codemod

    content = getattr(edit, "content", None)
    if not isinstance(content, str) or not content.endswith(".py") or content.startswith("/") or ".." in content:
        fail(where + ".content", f"{content!r} must be a .py path relative to {path.parent}")
    if not (path.parent / content).is_file():
        fail(where + ".content", f"{path.parent / content} does not exist")
    if edit.anchor != ():
        fail(where + ".anchor", "a NewFile's anchor is the file's absence; do not set one")
    if edit.rewrite is not Codemod.rewrite:
        fail(where + ".rewrite", "a NewFile writes its content file; it has no rewrite")
    for attr, required in (("patched", True), ("upstream", False)):
        value = getattr(edit, attr, None)
        if value is None and not required:
            continue
        if not isinstance(value, tuple) or not value or not all(isinstance(x, m.BaseMatcherNode) for x in value):
            fail(f"{where}.{attr}", "must be a non-empty tuple of libcst matchers")
