"""Image definitions: ``images/<name>.toml`` — which patches, which SMs, how to tag and serve.

Public API:
    ImageDefinition, ModelPreset     the parsed definition
    ImageDefinition.tag(cuda, sm, pin) -> str   the one tag rule (checked against the OCI grammar)
    ImageDefinition.target(pin, sm=None) -> BuildTarget
    ImageDefinition.pins_of(pins) -> list[Pin]   the pins it is built for
    load_definition(images_dir, name, catalogue, pins) -> ImageDefinition
    load_definitions(images_dir, catalogue, pins) -> list[ImageDefinition]   every one
    check_sm(value, where) -> int    the one SM validation (options and definitions)
    KNOWN_SMS

An image definition is data. Loading it validates everything that can be decided without
source: the patches exist, none conflict, every ``requires`` is selected, no patch is gated
off for one of the image's SMs or its model preset, the destination repository and the tag
template are well-formed and every tag it renders is a valid OCI tag.
"""

from __future__ import annotations

import dataclasses
import re
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.oci.reference import check_tag, parse_reference
from kiln.patch.catalog import Catalogue, current_id
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
    repository: str  # where `build --push` sends it, e.g. ghcr.io/you/vllm-qwen3.6-27b-tq; "" = not set
    pins: tuple[str, ...]  # () = every pin in pins.toml
    patches: tuple[str, ...]
    sms: tuple[int, ...]
    tag_template: str
    model: ModelPreset
    serve_args: tuple[str, ...]
    serve_env: dict[str, str]

    def tag(self, cuda: str, sm: int, pin: Pin) -> str:
        """The image's tag for a pin and SM, ``cuda`` being the pin's resolved CUDA flavour."""
        tag = self.tag_template.format(cuda=cuda, sm=sm, pin=pin.name)
        return check_tag(tag, f"{self.path}: tag {self.tag_template!r} renders {tag!r}, which")

    def pins_of(self, pins: dict[str, Pin]) -> list[Pin]:
        """The pins this image is built for (all of ``pins`` when it names none)."""
        return [pins[name] for name in (self.pins or tuple(pins))]

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


def check_sm(value, where: str) -> int:
    """An SM as kiln targets it (``86``, ``120``); ``where`` names the field or option."""
    try:
        sm = int(str(value).removeprefix("sm_").removeprefix("sm"))
    except ValueError:
        raise KilnError(f"{where}: {value!r} is not an SM like 86 or 120") from None
    if isinstance(value, bool) or sm not in KNOWN_SMS:
        known = ", ".join(map(str, sorted(KNOWN_SMS)))
        raise KilnError(f"{where}: sm_{sm} is not an NVIDIA arch kiln can target ({known})")
    return sm


def load_definitions(images_dir: Path, catalogue: Catalogue, pins: dict[str, Pin]) -> list[ImageDefinition]:
    return [load_definition(images_dir, p.stem, catalogue, pins) for p in sorted(images_dir.glob("*.toml"))]


def load_definition(images_dir: Path, name: str, catalogue: Catalogue, pins: dict[str, Pin]) -> ImageDefinition:
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
    repository = raw.get("repository", "")
    if not isinstance(repository, str):
        fail("repository", "must be a string like ghcr.io/you/vllm-qwen")
    if repository:
        try:
            destination = parse_reference(repository)
        except KilnError as err:
            fail("repository", str(err))
        if destination.digest or destination.tag != "latest" or repository.endswith(":latest"):
            fail("repository", f"{repository!r} must be a repository without a tag or digest")
    tag_template = string_field(raw, "tag", "")
    fields = {f for _, f, _, _ in string.Formatter().parse(tag_template) if f is not None}
    if not fields <= TAG_FIELDS or "sm" not in fields or "pin" not in fields:
        fail("tag", f"{tag_template!r} may use {{cuda}}, {{sm}}, {{pin}} and must use {{sm}} and {{pin}}")

    patches = raw.get("patches")
    if not isinstance(patches, list) or not patches or not all(isinstance(p, str) for p in patches):
        fail("patches", "must be a non-empty list of patch ids")
    patches = [current_id(pid) for pid in patches]  # an id renamed since still names its patch
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
        check_sm(sm, f"{path}: sms")

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
    for pin in image.pins_of(pins):
        for sm in image.sms:
            image.tag(pin.cuda, sm, pin)  # every tag it would push is a valid OCI tag
            target = BuildTarget(pin.vllm, sm, model.kv_cache_dtype, model.architectures)
            for pid in patches:
                gates = catalogue.get(pid).gates
                # the vLLM version gate is a per-pin verdict (GATED), reported by verify
                blocked = dataclasses.replace(gates, vllm="").blocks(target)
                if blocked:
                    fail("patches", f"{pid} is gated off for sm_{sm}: {blocked}")
    return image
