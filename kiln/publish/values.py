"""Helm values for a kiln image: what a chart needs to run it, the image pinned by digest.

Public API:
    VALUES_SCHEMA                          ``kiln/schemas/helm/values.schema.json`` (JSON Schema 2020-12)
    CHARTS                                 the charts values are written for: ``kiln``, ``vllm-stack``
    helm_values(definition, pin, sm, repository, tag, digest) -> dict      kiln's own
    chart_values(chart, definition, pin, sm, repository, tag, digest) -> dict
    check_chart(chart, definition, pin)    refuse, before any work, serve args the chart cannot take
                                           (and the CPU pin: values ask for a GPU node)
    values_bytes(values) -> bytes          the values file's exact bytes
    ValuesPublisher(path, repository, chart="kiln", definition=None, pin=None)   ``build --values FILE``
    built_values(inputs, config, repository=None, chart="kiln") -> dict  values of a pushed image: the
                                           tag's digest, an index's when the SM ships on several platforms
                                           (it must hold exactly those, each kiln's image)

The values hold only what the build knows: the image (repository, tag, manifest digest), the
model preset's id, the image definition's ``[serve]`` args and env, one GPU, and a node
selector on the GPU feature discovery labels of the SM the image is built for (an sm_86 image
carries sm_86 Triton kernels and SM-gated patches). ``build --values FILE`` writes them at
build time; ``build.py values`` derives the same bytes later from the registry, so the
values of an image are a function of (image definition, pin, SM, digest) only. ``--chart
vllm-stack`` writes the same facts in the shape of vLLM production-stack's chart
(``kiln.publish.vllm_stack``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kiln import labels as L
from kiln.definitions import ImageDefinition
from kiln.errors import KilnError
from kiln.image.inputs import BuildInputs, destination
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.mediatypes import INDEX_TYPES
from kiln.oci.reference import ImageReference
from kiln.oci.registry import RegistryClient
from kiln.pins import Pin
from kiln.publish import Input, Publisher
from kiln.publish.vllm_stack import vllm_config, vllm_stack_values
from kiln.staging import Staged, stage_bytes

# package data (pyproject.toml), so an installed kiln has it too
VALUES_SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "helm" / "values.schema.json"
GPU_RESOURCE = "nvidia.com/gpu"
# Node labels set by NVIDIA GPU feature discovery (part of the GPU operator).
COMPUTE_MAJOR = "nvidia.com/gpu.compute.major"
COMPUTE_MINOR = "nvidia.com/gpu.compute.minor"
CHARTS = ("kiln", "vllm-stack")


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


def chart_values(chart: str, definition: ImageDefinition, pin: Pin, sm: int, repository: str, tag: str,
                 digest: str) -> dict:
    values = helm_values(definition, pin, sm, repository, tag, digest)
    if chart == "vllm-stack":
        return vllm_stack_values(values, f"{definition.path}: serve.args")
    return values


def check_chart(chart: str, definition: ImageDefinition, pin: Pin | None = None) -> None:
    if pin is not None and pin.cpu:
        raise KilnError(f"pin {pin.name}: the CPU pin's images are served by ci/serve_check; Helm values "
                        f"(a GPU request, an SM node selector) are for GPU pins")
    if chart not in CHARTS:
        raise KilnError(f"--chart {chart}: unknown chart (charts: {', '.join(CHARTS)})")
    if chart == "vllm-stack":
        vllm_config(definition.serve_args, f"{definition.path}: serve.args")


def values_bytes(values: dict) -> bytes:
    """JSON (which Helm reads as YAML): no implicit typing of values like ``"1"`` or ``"on"``."""
    return (json.dumps(values, indent=2) + "\n").encode()


class ValuesPublisher(Publisher):
    kind = "values"
    option = "--values"

    def __init__(self, path: Path, repository: ImageReference, chart: str = "kiln",
                 definition: ImageDefinition | None = None, pin: Pin | None = None):
        self.path = path
        self.repository = repository
        self.chart = chart
        self.definition = definition
        self.pin = pin

    def check(self, inputs: Sequence[Input] = ()) -> None:
        super().check(inputs)
        if self.definition is not None:
            check_chart(self.chart, self.definition, self.pin)

    def values(self, image) -> dict:
        inputs = image.prepared.inputs
        return chart_values(self.chart, inputs.definition, inputs.pin, inputs.sm, self.repository.name, image.tag,
                            image.manifest.digest)

    def stage(self, image) -> Staged:
        return stage_bytes(self.path, values_bytes(self.values(image)))

    def where(self, image) -> str:
        return str(self.path)


def built_values(inputs: BuildInputs, config: RegistryConfig, repository: str | None = None,
                 chart: str = "kiln") -> dict:
    """The values of the image ``build --push`` published for (definition, pin, sm)."""
    definition, pin, sm = inputs.definition, inputs.pin, inputs.sm
    check_chart(chart, definition, pin)
    dest = destination(definition, repository, purpose="Helm values")
    tag = inputs.tag
    where = f"{dest.name}:{tag}"
    client = RegistryClient.for_registry(dest.registry, config)
    try:
        manifest = client.get_manifest(dest.repository, tag)
    except KilnError as err:
        if "not found" not in str(err):
            raise
        raise KilnError(
            f"{where}: no such image, {definition.name} was never built for pin {pin.name} sm {sm} "
            f"(build.py build --image {definition.name} --pin {pin.name} --sm {sm} --push)"
        ) from None
    if manifest.media_type in INDEX_TYPES:
        _check_index(client, dest.repository, manifest, inputs, where)
    else:
        _check_annotations(manifest, inputs, f"{where}@{manifest.digest}")
    return chart_values(chart, definition, pin, sm, dest.name, tag, manifest.digest)


def _check_annotations(manifest, inputs: BuildInputs, what: str) -> None:
    definition, pin, sm = inputs.definition, inputs.pin, inputs.sm
    annotations = manifest.json.get("annotations") or {}
    expected = {L.IMAGE: definition.name, L.PIN: pin.name, L.SM: str(sm)}
    wrong = {k: annotations.get(k) for k, v in expected.items() if annotations.get(k) != v}
    if wrong:
        found = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        raise KilnError(f"{what}: not kiln's {definition.name} {pin.name} sm {sm} image ({found})")


def _check_index(client: RegistryClient, repository: str, index, inputs: BuildInputs, where: str) -> None:
    """The tag names an index (the SM ships on several platforms): the values pin the index's digest,
    once it holds exactly the platforms the definition ships the SM on, each kiln's image of it."""
    definition, pin, sm = inputs.definition, inputs.pin, inputs.sm
    shipped = definition.platforms_of(sm)
    entries = {f"{(e.platform or {}).get('os', '?')}/{(e.platform or {}).get('architecture', '?')}": e
               for e in index.manifests}
    missing = [platform for platform in shipped if platform not in entries]
    extra = [platform for platform in entries if platform not in shipped]
    if missing or extra:
        what = f"lacks {', '.join(missing)}" if missing else f"also holds {', '.join(extra)}"
        raise KilnError(f"{where}@{index.digest}: the index {what}; {definition.name} ships sm {sm} on "
                        f"{', '.join(shipped)} (build.py build --image {definition.name} --pin {pin.name} "
                        f"--sm {sm} --push)")
    for platform in shipped:
        manifest = client.get_manifest(repository, entries[platform].digest)
        if manifest.media_type in INDEX_TYPES:
            raise KilnError(f"{where}@{index.digest}: its {platform} entry is an index, not an image")
        _check_annotations(manifest, inputs, f"{where}@{index.digest} {platform} ({manifest.digest})")
