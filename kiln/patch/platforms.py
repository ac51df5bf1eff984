"""Verdicts across a pin's platforms: once when the files kiln patches are the same, else each.

Public API:
    patched_files(catalogue, ids=None) -> list[str]   every file (vllm-relative) the patches target
    differing_files(trees, files) -> list[str]        those whose bytes differ between the trees
                                                      (present on one platform only counts)
    PlatformVerdicts(platforms, outcomes, by_platform, differing)
        .shared -> bool                               one set of verdicts stands for every platform
        .of(platform) -> outcomes
    platform_verdicts(trees, files, compute, reporter=SILENT) -> PlatformVerdicts

vLLM publishes its release as one wheel per platform (x86_64, aarch64), and each platform's
image installs its own; every ``.py`` file kiln patches is byte-identical between the two wheels
of both pins (``tests/source/test_platform_wheels.py``, on the real wheels). Verdicts are a
function of the files a patch reads, so while those files are equal one set of verdicts (the
first platform's) is the verdict of every platform: they are computed once, and ``verify``'s
record and the release train stay as they are (one table per pin). When they are not equal the
verdicts are computed per platform, both are kept (``by_platform``), and the reporter says so in
one warning line naming the platforms and the first differing files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kiln.patch.catalog import Catalogue
from kiln.report import SILENT, Reporter
from kiln.source.tree import SourceTree


def patched_files(catalogue: Catalogue, ids: Iterable[str] | None = None) -> list[str]:
    chosen = catalogue.closure(list(ids)) if ids is not None else list(catalogue.patches)
    return sorted({rel for pid in chosen for rel in catalogue.get(pid).targets})


def differing_files(trees: dict[str, SourceTree], files: Iterable[str]) -> list[str]:
    """The files (vllm-relative) not byte-identical across ``trees``."""
    differ = []
    for rel in files:
        seen = {tree.file(rel).read_bytes() if tree.exists(rel) else None for tree in trees.values()}
        if len(seen) > 1:
            differ.append(rel)
    return differ


@dataclass(frozen=True)
class PlatformVerdicts:
    platforms: tuple[str, ...]
    outcomes: dict  # the verdicts every platform shares (the first platform's when they differ)
    by_platform: dict[str, dict] = field(default_factory=dict)  # each platform's, only when they differ
    differing: tuple[str, ...] = ()

    @property
    def shared(self) -> bool:
        return not self.differing

    def of(self, platform: str) -> dict:
        return self.by_platform.get(platform, self.outcomes)


def platform_verdicts(trees: dict[str, SourceTree], files: Iterable[str], compute: Callable[[SourceTree], dict],
                      reporter: Reporter = SILENT) -> PlatformVerdicts:
    """``compute`` (a tree -> its verdicts) once when ``files`` are the same on every platform of
    ``trees`` (platform -> its pristine tree), else once per platform, with one warning line."""
    platforms = tuple(trees)
    first = trees[platforms[0]]
    differ = tuple(differing_files(trees, files)) if len(trees) > 1 else ()
    if not differ:
        return PlatformVerdicts(platforms, compute(first))
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    reporter.warn(f"vLLM {first.vllm_version}: the files kiln patches differ between {', '.join(platforms)} "
                  f"({shown}); verdicts computed and recorded per platform")
    by_platform = {platform: compute(tree) for platform, tree in trees.items()}
    return PlatformVerdicts(platforms, by_platform[platforms[0]], by_platform, differ)
