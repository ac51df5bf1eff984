"""The warm layer (``docs/WARM.md``): what a warm cache depends on, the refusal of one made for
other inputs, and the build with the cache baked as its top layer.

Public API:
    WARM_ROOT, CACHE_DIRS, warm_env(image_env)   the layer's place in the image, the env pointing vLLM there
    key_factors(audit, definition, os_arch) -> dict; warm_key(factors) -> str
    check_bundle(record, audit, definition, os_arch, where)   the one-line refusal of another build's cache
    warm_contents(files, key) -> LayerContents; bundle_summary(record, record_bytes) -> dict
    bake_warm(prepared, summary, files, where) -> PreparedBuild   the warm layer on top, env and audit set

It lives with the image, not in ``kiln.warm`` (the step that makes a cache by booting vLLM), because
``check`` (``kiln.attest.recheck``) re-derives a warm image with it: every layer but the warm one is
re-made, and the warm one is baked again from the files the image carries, under the same key check.

The key hashes every input that changes what vLLM and its compilers would write: the base (its
digest fixes Python, torch, Triton and every library; the platform), vLLM's version, kiln's patch
set (each patch's verdict and each patched file's sha256), the SM, the model and the serve args
and env. The warm step reads them from the booted image's own ``/opt/kiln/manifest.json`` and the
definition; a build reads the same from its audit record, so both sides compute one key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from kiln.errors import KilnError
from kiln.image.layers import AUDIT_PATH
from kiln.image.prepare import PreparedBuild
from kiln.oci.layer import LayerContents
from kiln.triton.cachelayer import image_env

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


# what a build records of the bundle (``PreparedBuild.warm``, the audit file's ``warm``, the SBOM, the provenance)
SUMMARY = ("key", "factors", "booted", "hardware", "versions", "vllm_cache_dirs", "bytes")


def bundle_summary(record: dict, record_bytes: bytes) -> dict:
    """What ``bake_warm`` takes of a bundle: its record's summary fields, the record's sha256, its files."""
    return {**{name: record.get(name) for name in SUMMARY},
            "record_sha256": hashlib.sha256(record_bytes).hexdigest(), "files": record.get("files") or {}}


def warm_contents(files: dict[str, bytes], key: str) -> LayerContents:
    """The warm layer: the captured files at their image paths (kiln's tar: sorted, fixed times, root-owned)."""
    return LayerContents(dict(sorted(files.items())), (), f"kiln warm {key[:19]}: vLLM compile caches")


def bake_warm(prepared: PreparedBuild, summary: dict, files: dict[str, bytes], where: str) -> PreparedBuild:
    """``prepared`` with ``files`` baked as its top layer. ``summary``: ``SUMMARY``'s fields of the
    bundle's record, its ``record_sha256`` and its ``files`` (image path -> sha256); refused in one
    line when its key is not this build's (``check_bundle``) or a file is not the one it lists."""
    listed = summary.get("files") or {}
    for rel in sorted(set(listed) | set(files)):
        data = files.get(rel)
        if data is None or hashlib.sha256(data).hexdigest() != listed.get(rel) or not rel.startswith(f"{WARM_ROOT}/"):
            raise KilnError(f"{where}: /{rel} is not the file the warm record lists (sha256 "
                            f"{str(listed.get(rel))[:16]}…)")
    source = prepared.layers[0]
    audit = json.loads(source.files[AUDIT_PATH])
    check_bundle(summary, audit, prepared.inputs.definition, prepared.inputs.platform, where)
    recorded = {name: summary.get(name) for name in (*SUMMARY, "record_sha256")}
    audit["warm"] = {**recorded, "files": dict(sorted(listed.items()))}
    text = (json.dumps(audit, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
    layers = [replace(source, files={**source.files, AUDIT_PATH: text}), *prepared.layers[1:],
              warm_contents(files, summary["key"])]
    env = {**prepared.env, **warm_env({**image_env(prepared.base_model.config), **prepared.env})}
    return replace(prepared, layers=layers, env=env, warm={**recorded, "files": len(listed)})
