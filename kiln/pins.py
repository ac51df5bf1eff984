"""`pins.toml`: the vLLM releases/images kiln builds against, each locked to a digest.

Public API:
    Pin                      name, role, image, vllm, cuda, digest (``.locked``)
    load_pins(path) -> dict[str, Pin]     validated; every error names the file and field
    get_pin(pins, name, path) -> Pin
    current_pin(pins), rollback_pin(pins) -> Pin | None
    check_pin_name(name, where) -> str    a pin name is part of image tags: the OCI tag grammar
    check_cuda(value, where) -> str       ``cu130``

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

ROLES = ("current", "rollback")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CUDA = re.compile(r"^cu\d{3}$")
_FIELDS = {"role", "image", "vllm", "cuda", "digest"}


@dataclass(frozen=True)
class Pin:
    name: str  # e.g. "v0.20.1"; used in tags and in the verdict record
    role: str  # "current" or "rollback"
    image: str  # image reference as users know it, e.g. docker.io/vllm/vllm-openai:v0.20.1
    vllm: Version  # the vLLM version the image carries
    cuda: str  # CUDA flavour used in tags, e.g. "cu130"
    digest: str  # "sha256:..." once locked, "" before

    @property
    def locked(self) -> bool:
        return bool(self.digest)


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
    pins_table = raw.get("pins")
    if not isinstance(pins_table, dict) or not pins_table:
        raise KilnError(f"{path}: missing table [pins.<name>] (no pin defined)")
    unknown_top = set(raw) - {"pins"}
    if unknown_top:
        raise KilnError(f"{path}: unknown top-level key {sorted(unknown_top)[0]!r}")
    pins: dict[str, Pin] = {}
    for name, entry in pins_table.items():
        where = f"{path}: pins.{name}"
        check_pin_name(name, f"{path}: pins")
        if not isinstance(entry, dict):
            raise KilnError(f"{where}: must be a table")
        extra = set(entry) - _FIELDS
        if extra:
            raise KilnError(f"{where}.{sorted(extra)[0]}: unknown field")
        for field in ("role", "image", "vllm", "cuda"):
            if not isinstance(entry.get(field), str) or not entry[field]:
                raise KilnError(f"{where}.{field}: missing or not a non-empty string")
        if entry["role"] not in ROLES:
            raise KilnError(f"{where}.role: {entry['role']!r} is not one of {', '.join(ROLES)}")
        try:
            version = Version(entry["vllm"])
        except InvalidVersion:
            raise KilnError(f"{where}.vllm: {entry['vllm']!r} is not a version") from None
        check_cuda(entry["cuda"], f"{where}.cuda")
        try:
            parse_reference(entry["image"])
        except KilnError as err:
            raise KilnError(f"{where}.image: {err}") from None
        digest = entry.get("digest", "")
        if not isinstance(digest, str) or (digest and not _DIGEST.match(digest)):
            raise KilnError(f"{where}.digest: {digest!r} is not 'sha256:<64 hex>' or empty")
        pins[name] = Pin(name, entry["role"], entry["image"], version, entry["cuda"], digest)
    # One pins file is one image line: the pin builds run on, and the one to roll back to.
    if len(pins) > len(ROLES):
        third = list(pins)[len(ROLES)]
        raise KilnError(
            f"{path}: pins.{third}: a third pin; a pins file holds at most two, one 'current' and one "
            f"'rollback' (found {', '.join(pins)}); `build.py pin bump` rotates them"
        )
    for role in ROLES:
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
