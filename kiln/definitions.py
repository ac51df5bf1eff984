"""Image definitions: ``images/<name>.toml`` — which patches, which SMs, how to tag and serve.

Public API:
    ImageDefinition, ModelPreset     the parsed definition
    BakedFile                        one ``[[files]]`` entry: a repository file baked into the image
    BAKED_ROOT                       "/opt/kiln/": the only directory baked files may go under
    ImageDefinition.tag(cuda, sm, pin) -> str   the one tag rule (checked against the OCI grammar)
    ImageDefinition.target(pin, sm=None) -> BuildTarget
    ImageDefinition.pins_of(pins) -> list[Pin]   the pins it is built for
    ImageDefinition.platforms_of(sm) -> tuple[str, ...]   the platforms it ships an SM on
    load_definition(images_dir, name, catalogue, pins) -> ImageDefinition
    load_definitions(images_dir, catalogue, pins) -> list[ImageDefinition]   every one
    check_sm(value, where) -> int    the one SM validation (options and definitions)
    KNOWN_SMS

An image definition is data, its keys and types declared once in ``kiln/schemas/image.schema.json``
(docs/DEFINITIONS.md); an unknown key or table is refused with the closest valid one. Loading it
then validates everything else that can be decided without source: the patches exist, none
conflict, every ``requires`` is selected, no patch is gated off for one of the image's SMs or its
model preset, the destination repository and the tag template are well-formed and every tag it
renders is a valid OCI tag, every baked file (``[[files]]``) exists inside the images directory
and goes to a distinct absolute path under ``/opt/kiln/``, and a ``--chat-template`` under
``/opt/kiln/`` in ``[serve] args`` names one of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import re
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.oci.reference import check_tag, parse_reference
from kiln.patch.catalog import Catalogue, current_id
from kiln.patch.outcome import BuildTarget
from kiln.pins import Pin
from kiln.schema import check
from kiln.targets import SMS, image_platforms, sm_platforms
from kiln.triton.kernels import KernelPreset, parse_kernel_preset

TAG_FIELDS = {"cuda", "sm", "pin"}
# SMs kiln builds for, each with the platforms it ships on: data (kiln/data/targets.toml).
KNOWN_SMS = set(SMS)
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# Baked files go under kiln's own directory of the image, where nothing of the base lives, so a
# file can never shadow (or be shadowed by) one of the base's; kiln's own records there are taken.
BAKED_ROOT = "/opt/kiln/"
_KILN_RESERVED = ("/opt/kiln/manifest.json", "/opt/kiln/triton-kernels.json", "/opt/kiln/triton-cache")
_BAKED_PATH = re.compile(r"^[A-Za-z0-9._+/-]+$")  # no whitespace or quoting: it goes into serve args
BAKED_MAX_BYTES = 1 << 20  # a template or config file, not a payload: the layer is meant to stay small


@dataclass(frozen=True)
class BakedFile:
    """A file of the kiln repository baked into the image: ``[[files]]`` of the definition."""

    source: str  # as written, relative to the images directory (e.g. "files/qwen3.6-chat.jinja")
    path: str  # absolute, normalised image path under /opt/kiln/
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class ModelPreset:
    """What the image is built to serve; feeds gates, kernel presets and Helm values."""

    id: str
    architectures: tuple[str, ...]
    dtype: str
    kv_cache_dtype: str
    spec_method: str | None = None
    num_speculative_tokens: int = 0
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
    files: tuple[BakedFile, ...] = ()  # [[files]]: baked into the patched-source layer
    platforms: dict[int, tuple[str, ...]] = field(default_factory=dict)  # per SM, narrowing kiln's table

    def platforms_of(self, sm: int) -> tuple[str, ...]:
        """The platforms the image ships ``sm`` on: its ``platforms``, else kiln's table's."""
        return self.platforms.get(sm) or sm_platforms(sm)

    def tag(self, cuda: str, sm: int, pin: Pin) -> str:
        """The image's tag for a pin and SM, ``cuda`` being the pin's resolved CUDA flavour."""
        tag = self.tag_template.format(cuda=cuda, sm=sm, pin=pin.name)
        return check_tag(tag, f"{self.path}: tag {self.tag_template!r} renders {tag!r}, which")

    def pins_of(self, pins: dict[str, Pin]) -> list[Pin]:
        """The pins this image is built for (when it names none: every GPU pin, not the CPU one)."""
        return [pins[name] for name in self.pins] if self.pins else [p for p in pins.values() if not p.cpu]

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

    check(raw, "image", path)  # keys, tables and types (kiln/schemas/image.schema.json)

    def fail(field_name: str, why: str):
        raise KilnError(f"{path}: {field_name}: {why}")

    if raw["name"] != name or not _NAME.match(name):
        fail("name", f"{raw['name']!r} must equal the file name {name!r} (lowercase, digits, . _ -)")
    repository = raw.get("repository", "")
    if repository:
        try:
            destination = parse_reference(repository)
        except KilnError as err:
            fail("repository", str(err))
        if destination.digest or destination.tag != "latest" or repository.endswith(":latest"):
            fail("repository", f"{repository!r} must be a repository without a tag or digest")
    tag_template = raw["tag"]
    fields = {f for _, f, _, _ in string.Formatter().parse(tag_template) if f is not None}
    if not fields <= TAG_FIELDS or "sm" not in fields or "pin" not in fields:
        fail("tag", f"{tag_template!r} may use {{cuda}}, {{sm}}, {{pin}} and must use {{sm}} and {{pin}}")

    patches = _selected_patches(raw["patches"], catalogue, fail)

    sms = raw["sms"]
    for sm in sms:
        check_sm(sm, f"{path}: sms")

    image_pins = raw.get("pins", [])
    for pin_name in image_pins:
        if pin_name not in pins:
            fail("pins", f"unknown pin {pin_name!r} (not in pins.toml)")

    model = _model_preset(raw["model"], fail)
    serve = raw.get("serve", {})
    args, env = serve.get("args", []), serve.get("env", {})

    files = tuple(_baked_file(images_dir, entry, i, fail) for i, entry in enumerate(raw.get("files", [])))
    paths = [f.path for f in files]
    for dup in sorted({p for p in paths if paths.count(p) > 1}):
        fail("files", f"two entries bake {dup}")
    _check_chat_template(args, {f.path for f in files}, fail)

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
        files=files,
        platforms=image_platforms(raw.get("platforms", {}), sms, fail),
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


def _selected_patches(listed: list[str], catalogue: Catalogue, fail) -> list[str]:
    """``patches``: each one known (by its current id), none twice, every ``requires`` selected, no
    two in conflict."""
    patches = [current_id(pid) for pid in listed]  # an id renamed since still names its patch
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
    return patches


def _model_preset(model_raw: dict, fail) -> ModelPreset:
    """``[model]``, with its ``[model.kernels]`` preset checked against the model's dtypes."""
    num_spec = model_raw.get("num_speculative_tokens", 0)
    dtype, kv_cache_dtype = model_raw["dtype"], model_raw["kv_cache_dtype"]
    kernels = None
    if "kernels" in model_raw:
        kernels = parse_kernel_preset(model_raw["kernels"], dtype, kv_cache_dtype, num_spec, fail)
    return ModelPreset(
        id=model_raw["id"],
        architectures=tuple(model_raw["architectures"]),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        spec_method=model_raw.get("spec_method"),
        num_speculative_tokens=num_spec,
        kernels=kernels,
    )


def _baked_file(images_dir: Path, entry: dict, index: int, fail) -> BakedFile:
    """One ``[[files]]`` entry, its source read now (small, and its bytes are the build's input)."""
    where = f"files[{index}]"
    source, path = entry["source"], entry["path"]
    if (not path.startswith(BAKED_ROOT) or not _BAKED_PATH.match(path) or posixpath.normpath(path) != path or "/../" in f"{path}/"
            or path.endswith("/")):
        fail(f"{where}.path", f"{path!r} must be a normalised absolute path under {BAKED_ROOT} "
                              "(kiln's directory: a baked file never shadows one of the base)")
    if any(path == r or path.startswith(r + "/") for r in _KILN_RESERVED):
        fail(f"{where}.path", f"{path!r} is kiln's own record in the image; choose another name")
    root = images_dir.resolve()
    rel = Path(source)
    found = (images_dir / rel).resolve()
    if rel.is_absolute() or ".." in rel.parts or not found.is_relative_to(root):
        fail(f"{where}.source", f"{source!r} must be a path inside {images_dir} (relative, no '..')")
    if not found.is_file():
        fail(f"{where}.source", f"{images_dir / rel}: no such file")
    data = found.read_bytes()
    if len(data) > BAKED_MAX_BYTES:
        fail(f"{where}.source", f"{images_dir / rel}: {len(data)} bytes, over the {BAKED_MAX_BYTES} a baked file may hold")
    return BakedFile(source=rel.as_posix(), path=path, data=data)


def _check_chat_template(args, baked: set[str], fail) -> None:
    """``--chat-template /opt/kiln/...`` must name a file the image bakes (nothing else is there)."""
    for i, arg in enumerate(args):
        if arg == "--chat-template":
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith("--chat-template="):
            value = arg.partition("=")[2]
        else:
            continue
        if not value:
            fail("serve.args", "--chat-template has no value")
        if value.startswith(BAKED_ROOT) and value not in baked:
            known = ", ".join(sorted(baked)) or "none"
            fail("serve.args", f"--chat-template {value} is not a file the image bakes ([[files]] paths: {known})")
