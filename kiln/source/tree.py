"""A pristine vLLM source tree on disk, and the interface every source provider implements."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from packaging.version import Version

from kiln.cache import cache_root


def module_name(rel: str) -> str:
    """The dotted module of a file of the ``vllm`` package (``v1/worker/gpu_model_runner.py`` ->
    ``vllm.v1.worker.gpu_model_runner``; a package's ``__init__.py`` is the package)."""
    return "vllm." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


@dataclass(frozen=True)
class SourceTree:
    """A read-only directory holding the ``vllm/`` package exactly as a release ships it.

    ``identity`` is a content address (e.g. the wheel's sha256, or a layer digest): two trees
    with the same identity hold the same bytes, which is what lets verdicts be memoised.
    """

    root: Path  # the directory containing ``vllm/``
    vllm_version: Version
    identity: str
    origin: str  # where it came from, for reports: "PyPI vllm-0.20.1-...whl (sha256:...)"

    @property
    def package(self) -> Path:
        return self.root / "vllm"

    def file(self, rel: str) -> Path:
        """Path of ``rel`` (relative to the ``vllm`` package, e.g. ``config/vllm.py``)."""
        return self.package / rel

    def exists(self, rel: str) -> bool:
        return self.file(rel).is_file()

    def read(self, rel: str) -> str:
        return self.file(rel).read_text(encoding="utf-8")

    def python_files(self) -> list[str]:
        """All ``.py`` files of the package, relative to it, sorted."""
        return sorted(p.relative_to(self.package).as_posix() for p in self.package.rglob("*.py"))


class SourceProvider(Protocol):
    """Anything that can produce the pristine tree for one vLLM pin or candidate."""

    def describe(self) -> str:
        """One line saying what will be fetched (for errors and reports)."""
        ...

    def fetch(self) -> SourceTree:
        """Return the tree, downloading and verifying into the cache if needed."""
        ...


class CachedProvider:
    """Base of the providers: the kiln cache they fill, claimed on first use (``cache_root``),
    so a run refused before any work creates no cache directory."""

    _cache: Path | None = None

    @property
    def cache(self) -> Path:
        if self._cache is None:
            self._cache = cache_root()
        return self._cache
