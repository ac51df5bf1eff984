"""Image definitions: ``images/<name>.toml`` — which patches, which SMs, how to tag and serve.

An image definition is data. Loading it validates everything that can be decided without
source: the patches exist, none conflict, every ``requires`` is selected, no patch is gated
off for one of the image's SMs or its model preset, and the tag template is well-formed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.patch.catalog import Catalogue
from kiln.patch.model import BuildTarget
from kiln.pins import Pin
from kiln.triton.kernels import KernelPreset, parse_kernel_preset

TAG_FIELDS = {"cuda", "sm", "pin"}
# SMs the Triton/CUDA toolchain in vLLM images targets (consumer and datacenter NVIDIA GPUs).
KNOWN_SMS = {75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121}
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class ModelPreset:
    """What the image is built to serve; feeds gates, kernel presets and Helm values."""

    id: str
    architectures: tuple[str, ...]
    dtype: str
    kv_cache_dtype: str
    spec_method: str | None = None
    num_speculative_tokens: int = 0
    extra: dict = field(default_factory=dict)  # anything else declared (head dims, ...)
    kernels: KernelPreset | None = None  # [model.kernels]: the Triton kernels to compile ahead of time


@dataclass(frozen=True)
class ImageDefinition:
    name: str
    path: Path
    description: str
    repository: str  # destination repository, e.g. docker.io/kiln/vllm-qwen3.6-27b-tq
    pins: tuple[str, ...]  # () = every pin in pins.toml
    patches: tuple[str, ...]
    sms: tuple[int, ...]
    tag_template: str
    model: ModelPreset
    serve_args: tuple[str, ...]
    serve_env: dict[str, str]

    def tag(self, pin: Pin, sm: int) -> str:
        return self.tag_template.format(cuda=pin.cuda, sm=sm, pin=pin.name)

    def target(self, pin: Pin, sm: int | None = None) -> BuildTarget:
        return BuildTarget(
            vllm_version=pin.vllm,
            sm=sm,
            kv_cache_dtype=self.model.kv_cache_dtype,
            architectures=self.model.architectures,
        )


def image_path(images_dir: Path, name: str) -> Path:
    path = images_dir / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in images_dir.glob("*.toml"))) or "none"
        raise KilnError(f"unknown image {name!r}: no {path} (images: {known})")
    return path


def load_image(images_dir: Path, name: str, catalogue: Catalogue, pins: dict[str, Pin]) -> ImageDefinition:
    path = image_path(images_dir, name)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise KilnError(f"{path}: not valid TOML: {err}") from None

    def fail(field_name: str, why: str):
        raise KilnError(f"{path}: {field_name}: {why}")

    def string_field(table: dict, key: str, where: str, required: bool = True) -> str:
        value = table.get(key, "" if not required else None)
        if not isinstance(value, str) or (required and not value):
            fail(where + key, "missing or not a non-empty string")
        return value

    if raw.get("name") != name or not _NAME.match(name):
        fail("name", f"{raw.get('name')!r} must equal the file name {name!r} (lowercase, digits, . _ -)")
    repository = string_field(raw, "repository", "")
    tag_template = string_field(raw, "tag", "")
    fields = {f for _, f, _, _ in string.Formatter().parse(tag_template) if f is not None}
    if not fields <= TAG_FIELDS or "sm" not in fields or "pin" not in fields:
        fail("tag", f"{tag_template!r} may use {{cuda}}, {{sm}}, {{pin}} and must use {{sm}} and {{pin}}")

    patches = raw.get("patches")
    if not isinstance(patches, list) or not patches or not all(isinstance(p, str) for p in patches):
        fail("patches", "must be a non-empty list of patch ids")
    if len(set(patches)) != len(patches):
        fail("patches", "lists a patch twice")
    for pid in patches:
        if pid not in catalogue.patches:
            fail("patches", f"unknown patch {pid!r}")
    selected = set(patches)
    for pid in patches:
        patch = catalogue.get(pid)
        for dep in patch.requires:
            if dep not in selected:
                fail("patches", f"{pid} requires {dep}, which the image does not select")
        for other in patch.conflicts:
            if other in selected:
                fail("patches", f"{pid} conflicts with {other}: select one")

    sms = raw.get("sms")
    if not isinstance(sms, list) or not sms or not all(isinstance(s, int) and not isinstance(s, bool) for s in sms):
        fail("sms", "must be a non-empty list of integers like 86, 120")
    for sm in sms:
        if sm not in KNOWN_SMS:
            fail("sms", f"sm_{sm} is not an NVIDIA arch kiln can target ({', '.join(map(str, sorted(KNOWN_SMS)))})")

    image_pins = raw.get("pins", [])
    if not isinstance(image_pins, list) or not all(isinstance(p, str) for p in image_pins):
        fail("pins", "must be a list of pin names")
    for pin_name in image_pins:
        if pin_name not in pins:
            fail("pins", f"unknown pin {pin_name!r} (not in pins.toml)")

    model_raw = raw.get("model")
    if not isinstance(model_raw, dict):
        fail("model", "missing [model] table")
    archs = model_raw.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        fail("model.architectures", "must be a non-empty list of strings")
    num_spec = model_raw.get("num_speculative_tokens", 0)
    if not isinstance(num_spec, int) or num_spec < 0:
        fail("model.num_speculative_tokens", "must be a non-negative integer")
    known_model = {"id", "architectures", "dtype", "kv_cache_dtype", "spec_method", "num_speculative_tokens",
                   "kernels"}
    dtype = string_field(model_raw, "dtype", "model.")
    kv_cache_dtype = string_field(model_raw, "kv_cache_dtype", "model.")
    kernels = None
    if "kernels" in model_raw:
        kernels = parse_kernel_preset(model_raw["kernels"], dtype, kv_cache_dtype, num_spec, fail)
    model = ModelPreset(
        id=string_field(model_raw, "id", "model."),
        architectures=tuple(archs),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        spec_method=model_raw.get("spec_method"),
        num_speculative_tokens=num_spec,
        extra={k: v for k, v in model_raw.items() if k not in known_model},
        kernels=kernels,
    )

    serve = raw.get("serve", {})
    args = serve.get("args", [])
    env = serve.get("env", {})
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        fail("serve.args", "must be a list of strings")
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        fail("serve.env", "must be a table of string values")

    image = ImageDefinition(
        name=name,
        path=path,
        description=raw.get("description", ""),
        repository=repository,
        pins=tuple(image_pins),
        patches=tuple(patches),
        sms=tuple(sms),
        tag_template=tag_template,
        model=model,
        serve_args=tuple(args),
        serve_env=dict(env),
    )
    # Build-time gates that depend only on the SM and the model preset: decided now, per SM.
    for pin_name in image.pins or tuple(pins):
        pin = pins[pin_name]
        for sm in image.sms:
            target = BuildTarget(pin.vllm, sm, model.kv_cache_dtype, model.architectures)
            for pid in patches:
                gates = catalogue.get(pid).gates
                # the vLLM version gate is a per-pin verdict (GATED), reported by verify
                blocked = dataclasses.replace(gates, vllm="").blocks(target)
                if blocked:
                    fail("patches", f"{pid} is gated off for sm_{sm}: {blocked}")
    return image


def image_pins(image: ImageDefinition, pins: dict[str, Pin]) -> list[Pin]:
    return [pins[name] for name in (image.pins or tuple(pins))]


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """``--image/--pin/--sm``: which image, pin and GPU arch (``build``, ``context``, ``values``)."""
    parser.add_argument("--image", required=True, help="an image definition in images/, e.g. qwen3.6-27b-tq")
    parser.add_argument("--pin", required=True, help="a pin from pins.toml, e.g. v0.20.1")
    parser.add_argument("--sm", type=int, required=True, help="target SM, one of the image's sms (e.g. 120)")
