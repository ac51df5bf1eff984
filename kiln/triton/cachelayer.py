"""The build step: an image's ahead-of-time Triton kernel cache as one more layer.

Public API:
    TritonLayer(contents, env, summary)
    triton_cache_layer(preset, sm, found, changed, runtime_env, cache, label, image_name, reporter=SILENT,
                       leave_out_unusable=False, wheels=None, platform=None) -> TritonLayer | None
                                     (None: left out; ``platform``: the image's, keyed for its machine)
    LEAVE_OUT_OPTION                 the build option that sets ``leave_out_unusable``
    image_env(config) -> dict       a base config's Env as a dict
    kernel_created_by(image_name, sm, kernels) -> str   the layer's history line

Called by ``kiln.image.prepare`` for images whose ``[model]`` declares ``kernels``:
checks that every declared launcher exists in the patched source, picks the toolchain for
the Triton the base carries, compiles and self-checks the SM's cache (reused from the kiln
cache when nothing changed) keyed as the image's own Triton keys them (``imagekey.py``: kiln may
run another Python than the image), and returns the layer's contents (the cache under
``RUNTIME_CACHE_DIR`` plus ``/opt/kiln/triton-kernels.json``) and the environment the image
needs (``TRITON_CACHE_DIR``). Kernels that cannot be built for a known reason (bf16 fp8 store
on sm < 89) are reported as a warning and listed in the audit file and the build summary.

A layer the image's Triton would never read (``imagekey.py``: its Triton is not the wheel kiln
compiles with, or cannot be checked) fails the build in one line, before anything is compiled:
shipping it would only look like a kernel cache. With ``leave_out_unusable`` (the build's
``--without-unusable-kernels``) the layer is left out instead, said so once, and the image gets
neither the cache nor ``TRITON_CACHE_DIR``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.oci.layer import LayerContents
from kiln.report import SILENT, Reporter
from kiln.source.image import ImageVllm
from kiln.targets import PLATFORMS
from kiln.triton.aot import KernelSources, compile_kernel_caches, kernel_cache_files
from kiln.triton.imagekey import RuntimeKey, platform_key, runtime_key
from kiln.triton.kernels import RUNTIME_CACHE_DIR, KernelPreset, check_kernels
from kiln.triton.keyfiles import read_key_sources
from kiln.triton.platformwheel import platform_wheel, wheel_arch
from kiln.triton.toolchain import toolchain_for

LEAVE_OUT_OPTION = "--without-unusable-kernels"


@dataclass(frozen=True)
class TritonLayer:
    contents: LayerContents
    env: dict[str, str]
    summary: dict  # for the build's --json


def triton_cache_layer(preset: KernelPreset, sm: int, found: ImageVllm, changed: dict[str, str],
                       runtime_env: dict[str, str], cache: Path, label: str, image_name: str,
                       reporter: Reporter = SILENT, leave_out_unusable: bool = False,
                       wheels=None, platform: str | None = None) -> TritonLayer | None:
    """``label`` names the preset in errors (``images/x.toml: model.kernels``); ``image_name`` the layer.
    None: the image could not use the layer and ``leave_out_unusable`` left it out.
    ``wheels``: the registry build cache's toolchain wheels (``toolchain_for``); ``platform``: the
    image's (``linux/arm64``: keyed for that machine's Triton wheel, ``platformwheel.py``)."""
    sources = KernelSources(changed, found.tree.root)
    check_kernels(preset, sources.read, label)
    toolchain = toolchain_for(found.triton_version, found.image, cache, reporter, wheels)
    python = _image_python(found.site_dir)
    keyed, image_ptxas, other = _image_key(found, toolchain, python, platform, cache, reporter)
    if keyed.problem:
        unusable = f"{label}: sm_{sm}: {keyed.problem}, so the image's Triton would never read these kernels"
        if not leave_out_unusable:
            raise KilnError(f"{unusable} (docs/TRITON.md); pass {LEAVE_OUT_OPTION} to build without them")
        reporter.warn(f"{unusable}: the kernel layer is left out ({LEAVE_OUT_OPTION})")
        return None
    # not "compiling": the kernels may come from kiln's cache, which the status then says
    with reporter.status(f"Triton kernels for sm_{sm} (Triton {toolchain.version})") as status:
        result = compile_kernel_caches(preset, [sm], sources, toolchain, cache, runtime_env=runtime_env,
                                       image_libtriton=keyed.libtriton_sha256, image_ptxas=image_ptxas)[sm]
        status.finish("from kiln's cache, none compiled" if result.cached
                      else f"{result.compiled} compiled and checked")
    for failure in result.failures:
        reporter.warn(f"sm_{sm}: kernel {failure['kernel']} "
                      f"({', '.join(f'{k}={v}' for k, v in failure['params'].items())}) is not in the cache: "
                      f"Triton {toolchain.version} cannot build it for sm_{sm} ({failure['error']}); "
                      "see docs/TRITON.md")
    files = kernel_cache_files(result, toolchain, preset)
    kernels = sorted({k["name"] for launch in result.launches for k in launch["kernels"]})
    summary = {"sm": sm, "triton": toolchain.version, "triton_wheel": toolchain.wheel,
               "triton_wheel_sha256": toolchain.wheel_sha256,
               "toolchain_record_sha256": toolchain.fingerprint, "image_python": python,
               "keyed_for_image": keyed.problem is None, "libtriton_sha256": result.libtriton,
               "cache_dir": RUNTIME_CACHE_DIR, "key": result.key,
               "kernels": len({k["hash"] for launch in result.launches for k in launch["kernels"]}),
               "kernel_names": kernels, "compiled": result.compiled, "from_cache": result.cached,
               "not_built": result.failures, "seconds": result.seconds,
               **({"platform": platform, "platform_wheel": other.to_json(), "ptxas_keyed": result.ptxas}
                  if other else {})}
    contents = LayerContents(files=files, removals=(), created_by=kernel_created_by(image_name, sm, kernels))
    return TritonLayer(contents, {"TRITON_CACHE_DIR": RUNTIME_CACHE_DIR}, summary)


def _image_key(found: ImageVllm, toolchain, python: str | None, platform: str | None, cache: Path,
               reporter: Reporter):
    """How the image's Triton keys kernels: (RuntimeKey, its ptxas texts or None, the platform's
    wheel or None). On the host's machine, by the toolchain's RECORD (``runtime_key``); on another
    (an arm64 image built here), by that machine's PyPI wheel (``platform_key``)."""
    sources = read_key_sources(toolchain.site, toolchain.version)
    arch = PLATFORMS.get(platform) if platform else None
    if arch is None or arch == wheel_arch(toolchain.wheel):
        return runtime_key(found.triton_record, toolchain.record, python, toolchain.wheel_python, sources), None, None
    if python is None:
        return RuntimeKey(None, toolchain.libtriton_sha256, f"the image's Python is unknown (site dir "
                                                            f"{found.site_dir}), so is its {arch} Triton wheel"), None, None
    try:
        other = platform_wheel(toolchain, python, arch, found.image, cache, reporter)
    except KilnError as err:
        return RuntimeKey(None, toolchain.libtriton_sha256, f"its {platform} Triton wheel: {err}"), None, None
    keyed = platform_key(found.triton_record, other.record, toolchain.record, sources, other.wheel)
    return keyed, other.ptxas, other


def kernel_created_by(image_name: str, sm: int, kernels: list[str]) -> str:
    """The kernel layer's history line (the image's: a registry cache entry is shared by images)."""
    return f"kiln triton cache {image_name} sm{sm}: {', '.join(kernels) or 'none'}"


def _image_python(site_dir: str) -> str | None:
    """``3.12`` from ``usr/local/lib/python3.12/dist-packages`` (None when the path does not say)."""
    match = re.search(r"/python(\d+\.\d+)/", f"/{site_dir}/")
    return match.group(1) if match else None


def image_env(config: dict) -> dict[str, str]:
    """The base config's ``Env`` as a dict."""
    env = {}
    for entry in (config.get("config") or {}).get("Env") or []:
        key, _, value = entry.partition("=")
        env[key] = value
    return env
