"""Helm values for vLLM production-stack's ``vllm-stack`` chart, translated from kiln's own.

Public API:
    VLLM_STACK_SCHEMA                      the chart's ``values.schema.json``, vendored (``SOURCE.toml``)
    vllm_config(args, where) -> (dict, int)  ``[serve] args`` as the chart's ``vllmConfig``; GPUs needed
    vllm_stack_values(values, where) -> dict  kiln's values (``kiln.publish.values``) for that chart

The chart (repository ``vllm-project/production-stack``, ``helm/``) runs each entry of
``servingEngineSpec.modelSpec`` as a Deployment whose container is
``"{repository}:{tag}"`` running ``vllm serve {modelURL} --host 0.0.0.0 --port …`` followed by
flags rendered from ``vllmConfig`` and then ``vllmConfig.extraArgs`` in order. So:

- the image is pinned by digest through ``tag``: ``cu130-sm120-v0.20.1@sha256:…`` renders
  ``repo:tag@sha256:…``, a reference the container runtime pulls by its digest;
- each serve flag the chart has a field for goes to that field, every other one (with its
  value) to ``extraArgs`` in the definition's order;
- when ``vllmConfig`` is present the chart always passes ``--enable-prefix-caching`` or
  ``--no-enable-prefix-caching``, so an image definition must say which (an error otherwise,
  rather than the chart silently turning prefix caching off); ``--host``/``--port`` belong to
  the chart (``servingEngineSpec.containerPort``) and are refused;
- the GPU request is a ``resources`` block (the chart renders it verbatim and then needs no
  CPU/memory figures kiln cannot know), mirrored in ``requestGPU``;
- the SM's node selector becomes ``nodeSelectorTerms`` (the chart's node affinity).
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln import labels as L
from kiln.errors import KilnError

# package data (pyproject.toml): kiln/schemas/helm/vllm-stack/, with its SOURCE.toml
VLLM_STACK_SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "helm" / "vllm-stack" / "values.schema.json"

# vllm serve flag -> (vllmConfig field, type of its value). The chart renders each one back as
# that flag (hasKey …: "--max-model-len" {{ .maxModelLen | quote }}), so the mapping is exact.
_VALUE_FIELDS: dict[str, tuple[str, type]] = {
    "--dtype": ("dtype", str),
    "--max-model-len": ("maxModelLen", int),
    "--tensor-parallel-size": ("tensorParallelSize", int),
    "--max-num-seqs": ("maxNumSeqs", int),
    "--gpu-memory-utilization": ("gpuMemoryUtilization", float),
    "--max-loras": ("maxLoras", int),
}
_SWITCHES: dict[str, tuple[str, bool]] = {
    "--enable-prefix-caching": ("enablePrefixCaching", True),
    "--no-enable-prefix-caching": ("enablePrefixCaching", False),
    "--enable-chunked-prefill": ("enableChunkedPrefill", True),
    "--no-enable-chunked-prefill": ("enableChunkedPrefill", False),
}
_PARALLEL = ("--tensor-parallel-size", "--pipeline-parallel-size")  # their product: the GPUs a replica needs
_SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
_CHART_OWNS = ("--host", "--port")  # the chart passes them itself (servingEngineSpec.containerPort)


def _flag(token: str) -> tuple[str, str | None]:
    """``--max_model_len=4`` -> ("--max-model-len", "4"): vLLM takes ``_`` and ``-`` alike."""
    name, eq, value = token.partition("=")
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return _SHORT.get(name, name), (value if eq else None)


def vllm_config(args: tuple[str, ...] | list[str], where: str) -> tuple[dict, int]:
    """The chart's ``vllmConfig`` for these ``vllm serve`` args, and the GPUs they need."""
    config: dict = {}
    extra: list[str] = []
    gpus = {flag: 1 for flag in _PARALLEL}
    i = 0
    while i < len(args):
        token = args[i]
        name, inline = _flag(token)
        if name in _CHART_OWNS:
            raise KilnError(f"{where}: {name}: the vllm-stack chart sets {name} itself "
                            "(servingEngineSpec.containerPort); remove it from the image's serve args")
        key = (_SWITCHES.get(name) or _VALUE_FIELDS.get(name) or (None,))[0]
        if key in config:
            raise KilnError(f"{where}: {token}: {key} is given twice in the serve args")
        if name in _SWITCHES and inline is None:
            config[key] = _SWITCHES[name][1]
            i += 1
            continue
        if name not in _VALUE_FIELDS and name not in _PARALLEL:
            extra.append(token)
            i += 1
            continue
        value = inline if inline is not None else (args[i + 1] if i + 1 < len(args) else None)
        if value is None:
            raise KilnError(f"{where}: {token}: no value follows it")
        taken = [token] if inline is not None else [token, value]
        i += len(taken)
        if name in _PARALLEL:
            try:
                gpus[name] = int(value)
            except ValueError:
                raise KilnError(f"{where}: {token}: {value!r} is not a number of GPUs") from None
        if key is None:
            extra += taken
            continue
        try:
            config[key] = _VALUE_FIELDS[name][1](value)
        except ValueError:  # a form the chart's field cannot hold (e.g. "128k"): passed on as given
            extra += taken
    if "enablePrefixCaching" not in config:
        raise KilnError(f"{where}: the vllm-stack chart passes --no-enable-prefix-caching unless told "
                        "otherwise; put --enable-prefix-caching or --no-enable-prefix-caching in the serve args")
    if extra:
        config["extraArgs"] = extra
    return config, gpus["--tensor-parallel-size"] * gpus["--pipeline-parallel-size"]


def _spec_name(image: str) -> str:
    """The image definition's name as a DNS label: the chart names Services ``<release>-<name>-…``."""
    return re.sub(r"[^a-z0-9]+", "-", image.lower()).strip("-")


def vllm_stack_values(values: dict, where: str) -> dict:
    """``values`` (kiln's own, ``kiln.publish.values.helm_values``) in the vllm-stack chart's shape."""
    image, kiln = values["image"], values["kiln"]
    config, gpus = vllm_config(values["serve"]["args"], where)
    (gpu_resource,) = values["resources"]["requests"]
    terms = [{"matchExpressions": [{"key": key, "operator": "In", "values": [value]}
                                   for key, value in values["nodeSelector"].items()]}]
    spec = {
        "name": _spec_name(kiln["image"]),
        "annotations": {L.IMAGE: kiln["image"], L.PIN: kiln["pin"], L.SM: str(kiln["sm"]), L.VLLM: kiln["vllm"]},
        "repository": image["repository"],
        "tag": f"{image['tag']}@{image['digest']}",  # rendered "repository:tag@digest": pulled by digest
        "modelURL": values["model"]["id"],
        "replicaCount": 1,
        "requestGPU": gpus,
        "resources": {"requests": {gpu_resource: gpus}, "limits": {gpu_resource: gpus}},
        "nodeSelectorTerms": terms,
        "vllmConfig": config,
        "env": values["serve"]["env"],
    }
    return {"servingEngineSpec": {"imagePullPolicy": image["pullPolicy"], "modelSpec": [spec]}}
