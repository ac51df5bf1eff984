"""`pins.toml`: the vLLM releases/images kiln builds against, each locked to a digest.

Public API:
    Pin                      name, role, image, vllm, cuda, digest (``.locked``), wheel, ``.cpu``,
                             platforms (``.platform_digest(name)``): each platform's manifest digest
    load_pins(path) -> dict[str, Pin]     validated against kiln/schemas/pins.schema.json, then
                                          the rest; every error names the file and field
    get_pin(pins, name, path) -> Pin
    current_pin(pins), rollback_pin(pins) -> Pin | None
    check_pin_name(name, where) -> str    a pin name is part of image tags: the OCI tag grammar
    check_cuda(value, where) -> str       ``cu130``

A locked pin has ``digest``: what ``image`` resolved to (an index's digest for a multi-platform
base) and, since pins record platforms, ``platforms``: ``{"linux/amd64" = "sha256:…", …}``, the
image manifest of each platform the base has (docs/BUILDING.md "Pins and platforms"). A pin
locked before that (``digest`` alone) still loads and builds: the index digest names every
entry's digest already, so the build takes its platform's manifest from the index as it always
did; what it lacks is the check with no request, and ``pin lock`` adds ``platforms`` to it.

Lifecycle: ``kiln.pinning.lock`` (resolve and record digests), ``kiln.pinning.bump`` (preflight a new
vLLM), ``kiln.pinning.rotate`` (write the bump).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kiln.errors import KilnError
from kiln.oci.reference import check_tag, parse_reference
from kiln.schema import check

ROLES = ("current", "rollback")  # the GPU image line: what builds run on, and what to roll back to
CPU_ROLE = "cpu"  # vLLM's CPU build, beside the GPU line: ci/serve_check serves it (docs/SERVE_CHECK.md)
CPU_FLAVOUR = "cpu"  # a CPU pin's `cuda`: no CUDA, and what fills {cuda} in its tags
_CUDA = re.compile(r"^cu\d{3}$")


@dataclass(frozen=True)
class Pin:
    name: str  # e.g. "v0.20.1"; used in tags and in the verdict record
    role: str  # "current", "rollback" or "cpu"
    image: str  # image reference as users know it, e.g. docker.io/vllm/vllm-openai:v0.20.1
    vllm: Version  # the vLLM version the image carries
    cuda: str  # CUDA flavour used in tags, e.g. "cu130"
    digest: str  # "sha256:..." once locked, "" before
    wheel: str = "vllm"  # the PyPI project whose release wheel is the source's fast path
    # ("linux/amd64", "sha256:…") per platform of the base, as `pin lock` recorded them; () for a
    # pin locked before platforms were recorded (or not locked)
    platforms: tuple[tuple[str, str], ...] = ()

    def platform_digest(self, platform: str) -> str | None:
        """The recorded manifest digest of ``platform``; None when not recorded."""
        return dict(self.platforms).get(platform)

    @property
    def locked(self) -> bool:
        return bool(self.digest)

    @property
    def cpu(self) -> bool:
        """vLLM's CPU build: no kernels, no place in the GPU build matrix or the pin rotation."""
        return self.role == CPU_ROLE


def check_pin_name(name: str, where: str) -> str:
    """Pin names end up in image tags (``cu130-sm120-<pin>``): they follow the OCI tag grammar."""
    return check_tag(name, f"{where}: pin name {name!r}")


def check_cuda(value: str, where: str) -> str:
    if not isinstance(value, str) or not _CUDA.match(value):
        raise KilnError(f"{where}: {value!r} is not a CUDA flavour like 'cu130'")
    return value


def current_pin(pins: dict[str, Pin]) -> Pin | None:
    return next((p for p in pins.values() if p.role == "current"), None)


def rollback_pin(pins: dict[str, Pin]) -> Pin | None:
    return next((p for p in pins.values() if p.role == "rollback"), None)


def load_pins(path: Path) -> dict[str, Pin]:
    """Parse and validate `pins.toml`; every error names the file and the field."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise KilnError(f"{path}: not valid TOML: {err}") from None
    check(raw, "pins", path)  # keys, tables and types (kiln/schemas/pins.schema.json)
    pins: dict[str, Pin] = {}
    for name, entry in raw["pins"].items():
        where = f"{path}: pins.{name}"
        check_pin_name(name, f"{path}: pins")
        try:
            version = Version(entry["vllm"])
        except InvalidVersion:
            raise KilnError(f"{where}.vllm: {entry['vllm']!r} is not a version") from None
        if entry["role"] == CPU_ROLE:
            if entry["cuda"] != CPU_FLAVOUR:
                raise KilnError(f"{where}.cuda: {entry['cuda']!r}; a pin with role 'cpu' has cuda = 'cpu'")
        elif entry["cuda"] == CPU_FLAVOUR:
            raise KilnError(f"{where}.cuda: 'cpu' is for a pin with role 'cpu' (this one is {entry['role']!r})")
        else:
            check_cuda(entry["cuda"], f"{where}.cuda")
        try:
            parse_reference(entry["image"])
        except KilnError as err:
            raise KilnError(f"{where}.image: {err}") from None
        digest = entry.get("digest", "")
        platforms = tuple(sorted(entry.get("platforms", {}).items()))
        if platforms and not digest:
            raise KilnError(f"{where}.platforms: recorded without a digest; `build.py pin lock {name}` writes both")
        pins[name] = Pin(name, entry["role"], entry["image"], version, entry["cuda"], digest,
                         entry.get("wheel", "vllm"), platforms)
    # One pins file is one GPU image line: the pin builds run on, and the one to roll back to
    # (plus, apart from that line, at most one CPU pin).
    gpu = [name for name, pin in pins.items() if not pin.cpu]
    if len(gpu) > len(ROLES):
        raise KilnError(
            f"{path}: pins.{gpu[len(ROLES)]}: a third GPU pin; a pins file holds at most two, one 'current' "
            f"and one 'rollback' (found {', '.join(gpu)}); `build.py pin bump` rotates them"
        )
    for role in (*ROLES, CPU_ROLE):
        holders = [p.name for p in pins.values() if p.role == role]
        if len(holders) > 1:
            raise KilnError(f"{path}: more than one pin has role {role!r} ({', '.join(holders)})")
    return pins


def get_pin(pins: dict[str, Pin], name: str, path: Path) -> Pin:
    try:
        return pins[name]
    except KeyError:
        known = ", ".join(sorted(pins)) or "none"
        raise KilnError(f"unknown pin {name!r} (pins in {path}: {known})") from None
