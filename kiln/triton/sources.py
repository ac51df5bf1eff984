"""The vLLM sources a kernel compile reads: the patched tree as the image holds it, which of its
files the compile depends on, and those files staged for the worker (``aot.py``).

Staged under ``STAGE/src-<content>/vllm/`` with a fixed mtime (ptxas records it in the line
info), so the same text gives the same kernels whichever build staged it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kiln import staging
from kiln.errors import KilnError, writing
from kiln.triton.kernels import KERNELS, KernelPreset
from kiln.triton.runtime_layout import RuntimeLayout, layout_for, vllm_version
from kiln.triton.toolchain import SOURCE_MTIME, stage_dir

_CONFIG_FILE = "model_executor/layers/quantization/turboquant/config.py"


@dataclass(frozen=True)
class KernelSources:
    changed: dict[str, str]  # vllm-relative path -> patched text (new files included)
    pristine_root: Path  # the directory holding the pristine ``vllm/``

    def read(self, rel: str) -> str | None:
        if rel in self.changed:
            return self.changed[rel]
        path = self.pristine_root / "vllm" / rel
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def runtime_layout(self) -> RuntimeLayout:
        """What this vLLM version hands the kernels (``runtime_layout.py``), from ``vllm/_version.py``."""
        version = vllm_version(self.read("_version.py"))
        if version is None:
            raise KilnError("vllm/_version.py: no vLLM version, so the kernels' block table layout is unknown")
        return layout_for(version)



def _kernel_dirs(preset: KernelPreset) -> list[str]:
    return sorted({KERNELS[name].file.rpartition("/")[0] for name in preset.launchers})


def reads_source(preset: KernelPreset, rel: str) -> bool:
    """Whether the compile of ``preset`` reads vLLM's ``rel`` (a patch to it changes the kernels;
    ``_version.py`` decides the launch plan's layout)."""
    return rel in (_CONFIG_FILE, "_version.py") or any(rel.startswith(directory + "/") for directory in _kernel_dirs(preset))


def stage_sources(preset: KernelPreset, sources: KernelSources) -> tuple[Path, str]:
    """The files the worker imports, under ``STAGE/src-<content>/vllm/`` (same text, same lines)."""
    dirs = _kernel_dirs(preset)
    rels = {_CONFIG_FILE}
    for directory in dirs:
        base = sources.pristine_root / "vllm" / directory
        rels |= {f"{directory}/{p.relative_to(base).as_posix()}" for p in base.rglob("*.py")}
        rels |= {rel for rel in sources.changed if rel.startswith(directory + "/") and rel.endswith(".py")}
    texts = {}
    for rel in sorted(rels):
        text = sources.read(rel)
        if text is not None:
            texts[rel] = text
    digest = hashlib.sha256()
    for rel, text in sorted(texts.items()):
        digest.update(f"{rel}\0{hashlib.sha256(text.encode()).hexdigest()}\n".encode())
    content = digest.hexdigest()
    final = stage_dir() / f"src-{content[:32]}"
    if not (final / ".complete").is_file():
        staging.remove_dead_stages(final.parent)  # what killed builds were staging here
        tmp = staging.stage_dir(final)
        try:
            with writing(final, sum(len(t.encode()) for t in texts.values()), "the Triton kernels' sources"):
                for rel, text in texts.items():
                    path = tmp / "vllm" / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(text, encoding="utf-8")
                    os.utime(path, (SOURCE_MTIME, SOURCE_MTIME))  # ptxas records it in the line info
                (tmp / ".complete").write_text(content)
            try:
                os.rename(tmp, final)
            except OSError:  # another build staged the same content first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for rel in texts:  # a directory staged by an older kiln kept the time it was written
        path = final / "vllm" / rel
        if path.stat().st_mtime != SOURCE_MTIME:
            os.utime(path, (SOURCE_MTIME, SOURCE_MTIME))
    return final, content
