"""Helm values for a kiln image: what a chart needs to run it, the image pinned by digest.

Public API:
    VALUES_SCHEMA                          ``ci/helm/values.schema.json`` (JSON Schema 2020-12)
    helm_values(definition, pin, sm, repository, tag, digest) -> dict
    values_bytes(values) -> bytes          the values file's exact bytes
    stage_values(values, dest) -> Staged   written beside ``dest``; ``commit()`` renames it there
    built_values(definition, pin, sm, config, repository=None) -> dict   values of a pushed image
    add_values_parser(subparsers)          registers ``values``

The values hold only what the build knows: the image (repository, tag, manifest digest), the
model preset's id, the image definition's ``[serve]`` args and env, one GPU, and a node
selector on the GPU feature discovery labels of the SM the image is built for (an sm_86 image
carries sm_86 Triton kernels and SM-gated patches). ``build --values FILE`` writes them at
build time; ``build.py values`` derives the same bytes later from the registry, so the
values of an image are a function of (image definition, pin, SM, digest) only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from kiln import paths
from kiln.errors import KilnError
from kiln.images import ImageDefinition, add_target_options, image_pins, load_image
from kiln.oci.endpoints import RegistryConfig, add_registry_options, config_from_options
from kiln.oci.mediatypes import INDEX_TYPES
from kiln.oci.reference import parse_reference
from kiln.oci.registry import RegistryClient
from kiln.oci.sinks import Staged
from kiln.patch.catalog import load_catalogue
from kiln.pins import Pin, get_pin, load_pins

VALUES_SCHEMA = paths.REPO / "ci" / "helm" / "values.schema.json"
GPU_RESOURCE = "nvidia.com/gpu"
# Node labels set by NVIDIA GPU feature discovery (part of the GPU operator).
COMPUTE_MAJOR = "nvidia.com/gpu.compute.major"
COMPUTE_MINOR = "nvidia.com/gpu.compute.minor"


def helm_values(definition: ImageDefinition, pin: Pin, sm: int, repository: str, tag: str, digest: str) -> dict:
    return {
        "image": {
            "repository": repository,
            "tag": tag,
            "digest": digest,
            "pullPolicy": "IfNotPresent",  # addressed by digest: what is cached is what was built
        },
        "model": {"id": definition.model.id},
        "serve": {
            "args": list(definition.serve_args),
            "env": [{"name": name, "value": value} for name, value in definition.serve_env.items()],
        },
        "resources": {"requests": {GPU_RESOURCE: 1}, "limits": {GPU_RESOURCE: 1}},
        "nodeSelector": {COMPUTE_MAJOR: str(sm // 10), COMPUTE_MINOR: str(sm % 10)},
        "kiln": {"image": definition.name, "pin": pin.name, "vllm": str(pin.vllm), "sm": sm},
    }


def values_bytes(values: dict) -> bytes:
    """JSON (which Helm reads as YAML): no implicit typing of values like ``"1"`` or ``"on"``."""
    return (json.dumps(values, indent=2) + "\n").encode()


def stage_values(values: dict, dest: Path) -> Staged:
    if dest.is_dir():
        raise KilnError(f"--values {dest}: is a directory, a file path is expected")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.tmp-")
    with os.fdopen(fd, "wb") as handle:
        handle.write(values_bytes(values))
    return Staged(Path(tmp), dest, is_dir=False)


def built_values(definition: ImageDefinition, pin: Pin, sm: int, config: RegistryConfig,
                 repository: str | None = None) -> dict:
    """The values of the image ``build --push`` published for (definition, pin, sm)."""
    if sm not in definition.sms:
        raise KilnError(f"{definition.path}: sm {sm} is not one of the image's sms {list(definition.sms)}")
    destination = parse_reference(repository or definition.repository)
    if destination.digest:
        raise KilnError(f"--repository {destination}: a repository, not a digest, is expected")
    tag = definition.tag(pin, sm)
    where = f"{destination.name}:{tag}"
    client = RegistryClient.for_registry(destination.registry, config)
    try:
        manifest = client.get_manifest(destination.repository, tag)
    except KilnError as err:
        if "not found" not in str(err):
            raise
        raise KilnError(
            f"{where}: no such image, {definition.name} was never built for pin {pin.name} sm {sm} "
            f"(build.py build --image {definition.name} --pin {pin.name} --sm {sm} --push)"
        ) from None
    annotations = {} if manifest.media_type in INDEX_TYPES else manifest.json.get("annotations") or {}
    expected = {"io.kiln.image": definition.name, "io.kiln.pin": pin.name, "io.kiln.sm": str(sm)}
    wrong = {k: annotations.get(k) for k, v in expected.items() if annotations.get(k) != v}
    if wrong:
        found = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        raise KilnError(f"{where}@{manifest.digest}: not kiln's {definition.name} {pin.name} sm {sm} image ({found})")
    return helm_values(definition, pin, sm, destination.name, tag, manifest.digest)


# -- command line ----------------------------------------------------------------------------


def cmd_values(args) -> int:
    catalogue = load_catalogue(args.patchsets)
    pins = load_pins(args.pins)
    definition = load_image(args.images, args.image, catalogue, pins)
    pin = get_pin(pins, args.pin, args.pins)
    if pin.name not in {p.name for p in image_pins(definition, pins)}:
        raise KilnError(f"{definition.path}: pin {pin.name} is not one this image is built for")
    values = built_values(definition, pin, args.sm, config_from_options(args), args.repository)
    sys.stdout.write(values_bytes(values).decode())
    return 0


def add_values_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("values", help="print the Helm values of an image already built and pushed")
    add_target_options(p)
    p.add_argument("--repository", help="the repository it was pushed to, instead of the image definition's")
    add_registry_options(p)
    p.set_defaults(func=cmd_values)
    return p
