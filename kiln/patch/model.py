"""The patch model: what a patch declares, and the verdict it gets on a pin.

A patch is one module in ``patchsets/<family>/`` defining one ``Patch`` subclass. Its source
edits are ``Codemod`` subclasses, one class per transform: a matcher *anchor* saying where,
a ``rewrite`` saying what, a *patched* matcher saying how the result looks (so a re-run is
recognised), and optionally an *upstream* matcher saying how the fix looks once vLLM ships it
(so a retired patch is told apart from a drifted one).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import libcst as cst
from packaging.version import Version

from kiln.patch.anchor import Anchor, count

# the outcome types, re-exported: this module is a patch module's one import of kiln's model
from kiln.patch.outcome import BuildTarget, Gates, Outcome, Verdict, outside_written_range

__all__ = ["BuildTarget", "Codemod", "Gates", "NewFile", "Outcome", "Patch", "Verdict"]


class Codemod:
    """One anchored rewrite of one target file. Subclass once per transform.

    Subclasses set ``target`` (path relative to the ``vllm`` package), ``anchor`` (matcher
    path reaching exactly one node), ``patched`` (matcher path that finds the rewritten shape)
    and optionally ``upstream`` (matcher path that finds vLLM's own fix), and implement
    ``rewrite``. Override ``is_upstream``/``is_patched`` only when a matcher path cannot say it.
    """

    target: ClassVar[str]
    anchor: ClassVar[Anchor]
    patched: ClassVar[Anchor]
    upstream: ClassVar[Anchor | None] = None

    def rewrite(self, node: cst.CSTNode) -> cst.CSTNode | cst.FlattenSentinel | cst.RemovalSentinel:
        """Return the replacement for the anchored node."""
        raise NotImplementedError

    def is_patched(self, module: cst.Module) -> bool:
        return count(module, self.patched) > 0

    def is_upstream(self, module: cst.Module) -> bool:
        return self.upstream is not None and count(module, self.upstream) > 0

    @classmethod
    def name(cls) -> str:
        return cls.__name__


class NewFile(Codemod):
    """A whole new file the patch adds to the tree. Subclass once per file.

    Subclasses set ``target`` (the new file's path relative to the ``vllm`` package),
    ``content`` (the file holding its text, relative to the patch module's directory: a real
    ``.py`` file, linted and reviewed like code) and ``patched`` (a matcher path finding this
    patch's marked definitions in it). The anchor is the file's *absence*: where the pristine
    tree lacks ``target`` the edit applies; where it has it, the file is this patch's
    (``patched``), vLLM's own (``upstream``), or someone else's, which is drift.
    """

    content: ClassVar[str]
    anchor: ClassVar[Anchor] = ()

    def text(self, patch: Patch) -> str:
        """The new file's text, read from beside the patch module."""
        return (Path(patch.source_file).parent / self.content).read_text(encoding="utf-8")


class Patch:
    """A fix for vLLM, declared as data plus its codemods. Subclass once per patch module."""

    id: ClassVar[str]  # "P65"
    family: ClassVar[str]  # must equal the patchsets/ directory it lives in
    title: ClassVar[str]
    why: ClassVar[str]  # the failure it fixes, 1-3 sentences
    upstream_refs: ClassVar[tuple[str, ...]] = ()  # "vllm#40880", ...
    requires: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[tuple[str, ...]] = ()
    gates: ClassVar[Gates] = Gates()
    # PEP 440 specifier of the releases the patch was written and judged for ("" = any): on a
    # release outside it the verdict is OUT_OF_RANGE, whatever the source holds. Unlike
    # ``gates.vllm`` (this release does not have the failure, or has it elsewhere) it says
    # nothing about the release: nobody has read it for this patch.
    written_for: ClassVar[str] = ""
    perf_critical: ClassVar[bool] = False  # a pin bump that loses it must stop
    variant: ClassVar[bool] = False  # an alternative an image opts into; not in the default set
    edits: ClassVar[tuple[type[Codemod], ...]]

    # Set by the catalogue loader: the module file, for reports and the verdict memo.
    source_file: ClassVar[str] = ""

    def upstream_fix(self, module_of) -> str | None:
        """Patch-level upstream detection for fixes that landed in another shape.

        ``module_of(rel)`` returns the parsed module for a path (or None if absent). Return a
        one-line explanation when vLLM already carries the fix, else None. The default relies
        on the codemods' ``upstream`` matchers only.
        """
        return None

    def outside_range(self, version: Version) -> str | None:
        """Why ``version`` is outside ``written_for``, or None when it is inside."""
        return outside_written_range(self.written_for, version)

    @property
    def targets(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for edit in self.edits:
            seen.setdefault(edit.target, None)
        return tuple(seen)
