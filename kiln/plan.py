"""The builds a change needs, as a GitHub Actions matrix (``build.py plan``).

Public API:
    Layout(root, pins, patchsets, images, record)     repo-relative locations of kiln's data
    Layout.discover(pins, patchsets, images, record) -> Layout   the git work tree holding them
    classify(path, layout, patch_files, baked_files=None) -> Kind   what a changed path is to the builds
    plan_builds(layout, since=None, include_worktree=False) -> Plan   ``since=None``: every build
    Plan.matrix() -> {"include": [{"image", "pin", "sm", "tag", "platforms"}, ...]}   one entry per
                      (image, pin, SM), not per platform: its job builds every platform the SM
                      ships on (``platforms``, space-separated) into one index, pushed once

What a changed path (between ``--since REV`` and HEAD, or the work tree) rebuilds:

==============  ====================================================  ============================
kind            paths                                                 rebuilds
==============  ====================================================  ============================
``pins``        ``pins.toml``                                         each image's entries for the
                                                                      pins added or changed (every
                                                                      field but ``role``); a
                                                                      removed pin rebuilds nothing
``image``       ``images/<name>.toml``                                that image: its pins x SMs
``baked``       a file under ``images/`` that a definition bakes      the images whose ``[[files]]``
                (``[[files]] source``, e.g. a chat template)          bake it: their pins x SMs
``patch``       ``patchsets/<family>/<patch>.py`` (a catalogue        the images whose selection
                module), or a file one of its edits adds              (with ``requires``) holds it
                (``content``, e.g. ``p67_files/...``)
``none``        ``*.md``, ``docs/``, ``tests/``, ``ci/``,             nothing: not read by a build
                ``.github/``, the verdict record, unbaked files in
                ``images/``, ``Dockerfile``, ``.gitignore`` ...
``engine``      everything else: ``kiln/``, ``build.py``,             every image, pin and SM
                ``pyproject.toml``, other files under ``patchsets/``
                (helpers the patch modules import) ...
==============  ====================================================  ============================

"engine" is the fallback on purpose: a path kiln does not know to be irrelevant may feed the
build (a new top-level module, a helper the patch modules import), so it rebuilds everything.
The verdict record is ``none``: ``build`` computes verdicts itself and never reads it.

The state after the change is HEAD's own files (exported from git), or the work tree with
``include_worktree`` (tracked changes and untracked files, not ignored ones). Pins are
compared parsed, so reformatting or a comment in ``pins.toml`` rebuilds nothing.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath

import git
from gitdb.exc import BadName, BadObject

from kiln.definitions import ImageDefinition, load_definition
from kiln.errors import KilnError
from kiln.patch.catalog import load_catalogue
from kiln.pins import Pin, load_pins

# Top-level directories and files no build reads.
_NOT_BUILD_INPUTS_DIRS = {"docs", "tests", "ci", ".github"}
# The Dockerfile is the alternative builder (build.py context); build.py build never reads it.
_NOT_BUILD_INPUTS_FILES = {".gitignore", ".gitattributes", "LICENSE", "NOTICE", "Dockerfile"}


class Kind(StrEnum):
    PINS = "pins"
    IMAGE = "image"
    PATCH = "patch"
    BAKED = "baked"
    NONE = "none"
    ENGINE = "engine"


@dataclass(frozen=True)
class Layout:
    root: Path  # the git work tree
    pins: PurePosixPath  # repo-relative
    patchsets: PurePosixPath
    images: PurePosixPath
    record: PurePosixPath

    @classmethod
    def discover(cls, pins: Path, patchsets: Path, images: Path, record: Path) -> Layout:
        try:
            repo = git.Repo(pins.resolve().parent, search_parent_directories=True)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise KilnError(f"{pins}: not inside a git repository (plan compares git revisions)") from None
        root = Path(repo.working_tree_dir).resolve()
        rel = {}
        for name, path in (("pins", pins), ("patchsets", patchsets), ("images", images), ("record", record)):
            try:
                rel[name] = PurePosixPath(path.resolve().relative_to(root).as_posix())
            except ValueError:
                raise KilnError(f"{path}: outside the git repository {root} that holds {pins}") from None
        return cls(root, **rel)


def classify(path: str, layout: Layout, patch_files: dict[str, str],
             baked_files: dict[str, set[str]] | None = None) -> Kind:
    """What a repo-relative (posix) path is to the builds; see the module docstring.

    ``patch_files``: repo-relative path -> patch id, for every file the catalogue's patches
    are made of (their modules and the content files their edits add). ``baked_files``:
    repo-relative path -> the images whose ``[[files]]`` bake it.
    """
    p = PurePosixPath(path)
    if p == layout.pins:
        return Kind.PINS
    if p.parent == layout.images and p.suffix == ".toml":
        return Kind.IMAGE
    if path in (baked_files or {}):
        return Kind.BAKED  # checked before the suffix: a baked README.md is still baked
    if p.suffix == ".md" or p == layout.record or layout.images in p.parents:
        return Kind.NONE  # load_definition reads images/<name>.toml and the files they bake (above)
    if layout.patchsets in p.parents:
        if path in patch_files:
            return Kind.PATCH
        inside = p.relative_to(layout.patchsets).parts
        removed_module = (len(inside) == 2 and p.suffix == ".py" and not inside[0].startswith(("_", "."))
                          and not inside[1].startswith("_"))
        # a removed module's images changed too (or no longer load); anything else may be
        # a helper the patch modules import
        return Kind.PATCH if removed_module else Kind.ENGINE
    if p.parts[0] in _NOT_BUILD_INPUTS_DIRS or str(p) in _NOT_BUILD_INPUTS_FILES:
        return Kind.NONE
    return Kind.ENGINE


@dataclass(frozen=True)
class Build:
    image: str
    pin: str
    sm: int
    tag: str
    platforms: tuple[str, ...] = ()  # every platform the image ships the SM on: one job, one index

    def to_json(self) -> dict:
        return {"image": self.image, "pin": self.pin, "sm": self.sm, "tag": self.tag,
                "platforms": " ".join(self.platforms)}


@dataclass
class Plan:
    since: str | None  # the commit compared against; None = every build
    head: str  # HEAD's commit, or "worktree"
    builds: list[Build] = field(default_factory=list)
    reasons: dict[Build, list[str]] = field(default_factory=dict)
    changes: dict[str, Kind] = field(default_factory=dict)  # path -> kind

    def matrix(self) -> dict:
        return {"include": [b.to_json() for b in self.builds]}


@dataclass
class _State:
    """The data a build reads, as of one revision."""

    pins: dict[str, Pin]
    images: dict[str, ImageDefinition]
    patch_files: dict[str, str]  # repo-relative path of a module or content file -> patch id
    closures: dict[str, set[str]]  # image -> its selection with everything it requires
    baked: dict[str, set[str]]  # repo-relative path of a [[files]] source -> the images baking it


def plan_builds(layout: Layout, since: str | None = None, include_worktree: bool = False) -> Plan:
    repo = git.Repo(layout.root)
    try:
        head = repo.head.commit
    except ValueError:
        raise KilnError(f"{layout.root}: the repository has no commit yet") from None
    base = _commit(repo, since) if since is not None else None
    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as tmp:
        if include_worktree:
            after = _load_state(layout, layout.root)
        else:
            after = _load_state(layout, _export(head, layout, Path(tmp) / "head"))
        plan = Plan(since=base.hexsha if base else None, head="worktree" if include_worktree else head.hexsha)
        # The CPU pin's base is made by ci/cpu_base.py and pushed to ci/serve_check's own registry:
        # ci/serve_check builds its image; the workflow's matrix holds the GPU builds.
        everything = [(image, pin) for image in after.images.values() for pin in image.pins_of(after.pins)
                      if not pin.cpu]
        wanted: dict[tuple[str, str], list[str]] = {}

        def want(image: ImageDefinition, pin: Pin, why: str) -> None:
            wanted.setdefault((image.name, pin.name), []).append(why)

        if base is None:
            for image, pin in everything:
                want(image, pin, "every build requested (--all)")
        else:
            changed = _changed_paths(repo, base, include_worktree)
            plan.changes = {path: classify(path, layout, after.patch_files, after.baked) for path in changed}
            engine = sorted(p for p, kind in plan.changes.items() if kind is Kind.ENGINE)
            if engine:
                listed = ", ".join(engine[:3]) + (f" (+{len(engine) - 3} more)" if len(engine) > 3 else "")
                for image, pin in everything:
                    want(image, pin, f"engine changed: {listed}")
            for path, kind in plan.changes.items():
                if kind is Kind.IMAGE:
                    image = after.images.get(PurePosixPath(path).stem)
                    for pin in image.pins_of(after.pins) if image else ():  # removed: nothing
                        if not pin.cpu:
                            want(image, pin, f"image definition changed: {path}")
                elif kind is Kind.BAKED:
                    for image, pin in everything:
                        if image.name in after.baked[path]:
                            want(image, pin, f"baked file changed: {path}")
                elif kind is Kind.PATCH and path in after.patch_files:  # a removed module: nothing
                    pid = after.patch_files[path]
                    for image, pin in everything:
                        if pid in after.closures[image.name]:
                            want(image, pin, f"patch {pid} changed: {path}")
            if Kind.PINS in plan.changes.values():
                before = _pins_at(base, layout, Path(tmp) / "before")
                for image, pin in everything:
                    if _pin_inputs(before.get(pin.name)) != _pin_inputs(pin):
                        want(image, pin, f"pin {pin.name} {'changed' if pin.name in before else 'added'}")

    pin_order = {name: i for i, name in enumerate(after.pins)}
    for image_name, pin_name in sorted(wanted, key=lambda k: (k[0], pin_order[k[1]])):
        image, pin = after.images[image_name], after.pins[pin_name]
        for sm in sorted(image.sms):
            build = Build(image.name, pin.name, sm, image.tag(pin.cuda, sm, pin), image.platforms_of(sm))
            plan.builds.append(build)
            plan.reasons[build] = list(dict.fromkeys(wanted[image_name, pin_name]))
    return plan


def _commit(repo: git.Repo, rev: str) -> git.Commit:
    try:  # rev-parse checks the object exists (repo.commit() of a full sha does not)
        return repo.commit(repo.git.rev_parse("--verify", "--end-of-options", f"{rev}^{{commit}}"))
    except (BadName, BadObject, ValueError, git.GitCommandError):
        raise KilnError(
            f"--since {rev!r}: no such commit in {repo.working_tree_dir} "
            "(a shallow clone? fetch the history, e.g. actions/checkout with fetch-depth: 0)"
        ) from None


def _changed_paths(repo: git.Repo, base: git.Commit, include_worktree: bool) -> list[str]:
    other = None if include_worktree else repo.head.commit
    paths: set[str] = set()
    for diff in base.diff(other):
        paths.update(p for p in (diff.a_path, diff.b_path) if p)
    if include_worktree:
        paths.update(repo.untracked_files)
    # Python's bytecode cache (an import of a patch module writes patchsets/<family>/__pycache__)
    # is never an input, whether or not the checkout's .gitignore names it
    return sorted(p for p in paths if "__pycache__" not in PurePosixPath(p).parts and not p.endswith((".pyc", ".pyo")))


def _pin_inputs(pin: Pin | None) -> Pin | None:
    """A pin as its images see it: every field but ``role`` (current/rollback), which no image holds."""
    return None if pin is None else dataclasses.replace(pin, role="")


def _pins_at(commit: git.Commit, layout: Layout, tmp: Path) -> dict[str, Pin]:
    """The pins as of ``commit``; none when the file was absent or is not valid there."""
    try:
        blob = commit.tree / str(layout.pins)
    except KeyError:
        return {}
    tmp.mkdir(parents=True)
    path = tmp / "pins.toml"
    path.write_bytes(blob.data_stream.read())
    try:
        return load_pins(path)
    except KilnError:
        return {}  # an invalid old file: every pin counts as added


def _export(commit: git.Commit, layout: Layout, dest: Path) -> Path:
    """Write ``commit``'s pins file, patchsets and image definitions under ``dest``."""
    for rel in (layout.pins, layout.patchsets, layout.images):
        try:
            item = commit.tree / str(rel)
        except KeyError:
            continue  # missing at HEAD: loading says which
        blobs = [item] if item.type == "blob" else [b for b in item.traverse() if b.type == "blob"]
        for blob in blobs:
            target = dest / blob.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(blob.data_stream.read())
    return dest


def _load_state(layout: Layout, root: Path) -> _State:
    pins_path, images_dir = root / layout.pins, root / layout.images
    catalogue = load_catalogue(root / layout.patchsets)
    pins = load_pins(pins_path)
    images = {}
    for path in sorted(images_dir.glob("*.toml")):
        images[path.stem] = load_definition(images_dir, path.stem, catalogue, pins)
    patch_files = {}
    for pid, patch in catalogue.patches.items():
        module = Path(patch.source_file).resolve()
        # a file an edit adds to vLLM is read from beside the module (``content``)
        added = [module.parent / e.content for e in patch.edits if isinstance(getattr(e, "content", None), str)]
        for path in (module, *added):
            patch_files[path.resolve().relative_to(root.resolve()).as_posix()] = pid
    closures = {name: set(catalogue.closure(list(image.patches))) for name, image in images.items()}
    baked: dict[str, set[str]] = {}
    for name, image in images.items():
        for baked_file in image.files:
            baked.setdefault((layout.images / baked_file.source).as_posix(), set()).add(name)
    return _State(pins, images, patch_files, closures, baked)
