"""What a warm cache depends on, and the refusal of one made for other inputs.

The key hashes every input that changes what vLLM and its compilers would write: the base (its
digest fixes Python, torch, Triton and every library; the platform), vLLM's version, kiln's patch
set (each patch's verdict and each patched file's sha256), the SM, the model and the serve args
and env. The warm step reads them from the booted image's own ``/opt/kiln/manifest.json`` and the
definition; a build reads the same from its audit record, so both sides compute one key.
"""

from __future__ import annotations

import hashlib
import json

from kiln.errors import KilnError

WARM_ROOT = "opt/kiln/warm"  # in the image, relative like every layer path
WARM_SCHEMA = 1
CACHE_DIRS = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


# Inductor makes a precompiled header with g++ (in /tmp, outside any cache dir) for every C++ kernel it
# loads, before it looks for the kernel's cached .so (torch/_inductor/codecache.py, _precompile_header):
# a warm image would run g++ at every boot. The header only speeds up compiling, which a warm boot skips.
NO_PRECOMPILED_HEADERS = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}


def warm_env(image_env: dict[str, str]) -> dict[str, str]:
    """The env entries pointing vLLM and its compilers at the warm layer. An image whose kernel
    layer already sets ``TRITON_CACHE_DIR`` (the AOT kernels) keeps it: Triton reads both there."""
    return {**{name: f"/{WARM_ROOT}/{sub}" for name, sub in CACHE_DIRS.items()
               if not (name == "TRITON_CACHE_DIR" and image_env.get(name))}, **NO_PRECOMPILED_HEADERS}


# the OCI platform of a machine (``platform.machine()``): what a warm boot compiled for
MACHINE_PLATFORMS = {"x86_64": "linux/amd64", "amd64": "linux/amd64", "aarch64": "linux/arm64", "arm64": "linux/arm64"}


def key_factors(audit: dict, definition, os_arch: str) -> dict:
    """Every input the key hashes, from an image's audit record, its definition and the platform
    (``linux/amd64``…: the base's digest may name an index of several, compiled code is per platform)."""
    pin = audit.get("pin") or {}
    return {
        "schema": WARM_SCHEMA,
        "image": audit.get("image"),
        "base_digest": (audit.get("base") or {}).get("digest"),
        "os_arch": os_arch,
        "vllm": pin.get("vllm"),
        "platform": pin.get("cuda"),
        "sm": audit.get("sm"),
        "patches": sorted(f"{p.get('patch')}={p.get('verdict')}" for p in audit.get("patches", [])),
        "files": {path: hashes.get("after") for path, hashes in sorted((audit.get("files") or {}).items())},
        "model": definition.model.id,
        "serve_args": list(definition.serve_args),
        "serve_env": dict(sorted(definition.serve_env.items())),
    }


def warm_key(factors: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def check_bundle(record: dict, audit: dict, definition, os_arch: str, where: str) -> None:
    """A bundle made for other inputs than this build's is refused in one line naming the first factor that differs."""
    want = key_factors(audit, definition, os_arch)
    have = record.get("factors") or {}
    if record.get("key") == warm_key(want) and have == want:
        return
    differ = [name for name in want if have.get(name) != want[name]] or ["key"]
    first = differ[0]
    shown = lambda value: json.dumps(value, sort_keys=True)[:80]  # noqa: E731
    raise KilnError(f"{where}: a warm cache made for other inputs ({len(differ)} differ; {first}: "
                    f"{shown(have.get(first))} here, {shown(want.get(first))} for this build): "
                    f"warm this image again (build.py warm)")
