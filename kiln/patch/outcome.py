"""What ``verify`` decides, as plain data: the verdicts, the build target, a patch's gates and its
outcome on one source.

Apart from ``kiln.patch.model`` (the ``Patch`` and ``Codemod`` classes, built on libcst) so that
what only reads or reports verdicts (the command line, a build served from the cache, the SBOM)
starts without importing libcst, whose matchers alone take a quarter of a second to import.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import StrEnum

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version


class Verdict(StrEnum):
    APPLIES = "APPLIES"  # anchors found once each: the patch will be applied
    ALREADY_PATCHED = "ALREADY_PATCHED"  # the patched shape is already there (idempotent re-run)
    UPSTREAM = "UPSTREAM"  # vLLM ships the fix: retire the patch for this pin
    DRIFTED = "DRIFTED"  # an anchor matched 0 or >1 times: re-anchor the patch
    TARGET_GONE = "TARGET_GONE"  # a target file does not exist in this pin
    GATED = "GATED"  # excluded by a version/SM/dtype/architecture gate or an unmet `requires`
    OUT_OF_RANGE = "OUT_OF_RANGE"  # the release is outside the releases the patch was written for
    CONFLICT = "CONFLICT"  # selected together with a patch it conflicts with

    @property
    def letter(self) -> str:
        """One letter, so a row of many releases fits a terminal (the release-train tables)."""
        return "R" if self is Verdict.OUT_OF_RANGE else "P" if self is Verdict.ALREADY_PATCHED else self.value[0]

    @property
    def ok(self) -> bool:
        """Verdicts under which the patch's effect is present in the output."""
        return self in (Verdict.APPLIES, Verdict.ALREADY_PATCHED)

    @property
    def blocks_build(self) -> bool:
        """The one rule of what stops a build (and ``diff``, ``apply``, ``verify --image``).

        A selected patch that cannot be placed (its anchor drifted, its file is gone, it
        conflicts) stops everything. One that is not needed on this source (``UPSTREAM``), not
        for this target (``GATED``), or already there (``ALREADY_PATCHED``) is left out and
        reported: the image carries the fix either way. One written for other releases
        (``OUT_OF_RANGE``) is left out and reported too, but nobody has judged that release:
        ``verify`` says so, naming the releases the patch was written for.
        """
        return self in (Verdict.DRIFTED, Verdict.TARGET_GONE, Verdict.CONFLICT)


@dataclass(frozen=True)
class BuildTarget:
    """What the build decides: the pin's vLLM version, and optionally the SM and model preset."""

    vllm_version: Version
    sm: int | None = None  # e.g. 86, 89, 90, 120; None = not decided (pin-level verify)
    kv_cache_dtype: str | None = None  # from the image's model preset
    architectures: tuple[str, ...] = ()  # from the image's model preset


def outside_written_range(written_for: str, version: Version) -> str | None:
    """Why ``version`` is outside a patch's ``written_for`` specifier, or None when it is inside."""
    if not written_for or SpecifierSet(written_for).contains(version, prereleases=True):
        return None
    return f"written for vllm{written_for}; this is {version}, which nobody has judged for this patch"


@dataclass(frozen=True)
class Gates:
    """Build-time applicability. Model-dependent behaviour stays a runtime guard in the code."""

    vllm: str = ""  # PEP 440 specifier set on the vLLM version, "" = any
    sm_min: int | None = None  # inclusive, e.g. 80
    sm_max: int | None = None  # inclusive, e.g. 120
    kv_cache_dtypes: tuple[str, ...] = ()  # fnmatch patterns, e.g. ("turboquant_*",); () = any
    architectures: tuple[str, ...] = ()  # model architectures, e.g. ("Qwen3_5ForCausalLM",); () = any

    def specifier(self) -> SpecifierSet:
        try:
            return SpecifierSet(self.vllm)
        except InvalidSpecifier as err:
            raise ValueError(f"gates.vllm {self.vllm!r} is not a version specifier") from err

    def blocks(self, target: BuildTarget) -> str | None:
        """Why this target is gated off, or None when every decided gate passes."""
        spec = self.specifier()
        if self.vllm and not spec.contains(target.vllm_version, prereleases=True):
            return f"vllm {target.vllm_version} not in {self.vllm}"
        if target.sm is not None:
            if self.sm_min is not None and target.sm < self.sm_min:
                return f"sm_{target.sm} below sm_{self.sm_min}"
            if self.sm_max is not None and target.sm > self.sm_max:
                return f"sm_{target.sm} above sm_{self.sm_max}"
        if target.kv_cache_dtype is not None and self.kv_cache_dtypes:
            if not any(fnmatch.fnmatchcase(target.kv_cache_dtype, p) for p in self.kv_cache_dtypes):
                return f"kv-cache dtype {target.kv_cache_dtype} not in {', '.join(self.kv_cache_dtypes)}"
        if target.architectures and self.architectures:
            if not set(target.architectures) & set(self.architectures):
                return f"architecture {', '.join(target.architectures)} not in {', '.join(self.architectures)}"
        return None

    def describe(self) -> str:
        parts = []
        if self.vllm:
            parts.append(f"vllm{self.vllm}")
        if self.sm_min is not None or self.sm_max is not None:
            parts.append(f"sm {self.sm_min or ''}..{self.sm_max or ''}")
        if self.kv_cache_dtypes:
            parts.append("kv " + "|".join(self.kv_cache_dtypes))
        if self.architectures:
            parts.append("arch " + "|".join(self.architectures))
        return ", ".join(parts) or "-"


@dataclass
class Outcome:
    """The verdict of one patch on one source, with what it touched."""

    patch_id: str
    verdict: Verdict
    detail: str = ""
    # rel path -> (sha256 before or None for a file the patch adds, sha256 after); only for
    # files this patch changed
    files: dict[str, tuple[str | None, str]] | None = None

    def to_json(self) -> dict:
        out = {"patch": self.patch_id, "verdict": str(self.verdict), "detail": self.detail}
        if self.files:
            out["files"] = {k: {"before": a, "after": b} for k, (a, b) in sorted(self.files.items())}
        return out
