"""The SMs kiln builds for and the platforms each ships on, as data (``kiln/data/targets.toml``).

Public API:
    SmTarget(sm, gpus, platforms, min_triton)   one row of the table
    SMS -> dict[int, SmTarget]              every SM kiln knows
    PLATFORMS -> dict[str, str]             every platform kiln knows ("linux/arm64") -> its wheel arch
    DEFAULT_PLATFORM                        "linux/amd64": a base or wheel with no platform named
    check_platform_name(value, where) -> str      "linux/arm64", a platform the table knows
    split_platform(name) -> (os, architecture)
    sm_platforms(sm) -> tuple[str, ...]     the platforms an SM ships on, the default first
    image_platforms(raw, sms, fail) -> dict[int, tuple[str, ...]]
                                            an image definition's ``platforms`` (per SM, narrowing
                                            the table's; a pair the table lacks is refused)
    check_platform_for_sm(sm, platform, allowed, where) -> str
    check_triton_for_sm(sm, triton_version, where)   an SM the base's Triton cannot compile for
    host_platform(machine=None) -> str      this machine's platform (``platform.machine()``: x86_64 ->
                                            linux/amd64, aarch64 -> linux/arm64)

A new SM or platform is a table in the TOML file, not code: ``kiln.definitions.check_sm`` and the
``--sm`` option take their SMs from here, the definitions' ``platforms`` and a build's
``--platform`` their platforms, the wheel source (``kiln.source.wheel``) the wheel arch of each.
The file's comments hold the evidence for each ``min_triton`` (the real Triton wheels' toolchains).
"""

from __future__ import annotations

import platform as _platform
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kiln.errors import KilnError

TABLE = Path(__file__).with_name("data") / "targets.toml"
DEFAULT_PLATFORM = "linux/amd64"
_PLATFORM = re.compile(r"^[a-z0-9]+/[a-z0-9]+$")


@dataclass(frozen=True)
class SmTarget:
    sm: int
    gpus: str
    platforms: tuple[str, ...]  # the default first
    min_triton: Version | None  # None: every Triton kiln meets compiles for it


def _load(path: Path = TABLE) -> tuple[dict[int, SmTarget], dict[str, str]]:
    """The table, checked: a broken table is kiln's bug, named by file and key."""
    raw = tomllib.loads(path.read_text())

    def bad(key: str, why: str):
        raise KilnError(f"{path}: {key}: {why}")

    platforms = {}
    for name, entry in raw["platforms"].items():
        if not _PLATFORM.match(name) or set(entry) != {"wheel_arch"}:
            bad(f"platforms.{name}", "a platform is 'os/arch' with one key, wheel_arch")
        platforms[name] = entry["wheel_arch"]
    sms = {}
    for key, entry in raw["sms"].items():
        if not key.isdigit() or not set(entry) <= {"gpus", "platforms", "min_triton"}:
            bad(f"sms.{key}", "an SM is a number with gpus, platforms and maybe min_triton")
        unknown = [p for p in entry["platforms"] if p not in platforms]
        if unknown or not entry["platforms"]:
            bad(f"sms.{key}.platforms", f"{unknown or 'none'}: not platforms of [platforms]")
        try:
            minimum = Version(entry["min_triton"]) if "min_triton" in entry else None
        except InvalidVersion:
            bad(f"sms.{key}.min_triton", f"{entry['min_triton']!r} is not a version")
        sms[int(key)] = SmTarget(int(key), entry["gpus"], tuple(entry["platforms"]), minimum)
    return sms, platforms


SMS, PLATFORMS = _load()


def split_platform(name: str) -> tuple[str, str]:
    os_name, _, arch = name.partition("/")
    return os_name, arch


def check_platform_name(value, where: str) -> str:
    """``linux/arm64``: a platform the table knows; ``where`` names the field or option."""
    if not isinstance(value, str) or value not in PLATFORMS:
        raise KilnError(f"{where}: {value!r} is not a platform kiln knows ({', '.join(PLATFORMS)})")
    return value


def sm_platforms(sm: int) -> tuple[str, ...]:
    return SMS[sm].platforms


def image_platforms(raw: dict, sms, fail) -> dict[int, tuple[str, ...]]:
    """An image definition's ``platforms`` table: SM -> the platforms it ships on, each one the
    table lists for that SM (``fail(field, why)`` raises the definition's one-line error)."""
    chosen = {}
    for key, names in raw.items():
        sm = int(key)  # the schema's propertyNames: digits
        if sm not in sms:
            fail(f"platforms.{key}", f"sm_{sm} is not one of the image's sms {list(sms)}")
        for name in names:
            if name not in PLATFORMS:
                fail(f"platforms.{key}", f"{name!r} is not a platform kiln knows ({', '.join(PLATFORMS)})")
            if name not in SMS[sm].platforms:
                fail(f"platforms.{key}", f"sm_{sm} does not ship on {name}: {SMS[sm].gpus} ships on "
                                         f"{', '.join(SMS[sm].platforms)} only (kiln/data/targets.toml)")
        if len(set(names)) != len(names):
            fail(f"platforms.{key}", "lists a platform twice")
        chosen[sm] = tuple(names)
    return chosen


def check_platform_for_sm(sm: int, platform: str, allowed: tuple[str, ...], where: str) -> str:
    """``platform`` is one the image ships ``sm`` on (``allowed``)."""
    check_platform_name(platform, where)
    if platform not in allowed:
        raise KilnError(f"{where}: {platform}: the image ships sm_{sm} on {', '.join(allowed)} only")
    return platform


def check_triton_for_sm(sm: int, triton_version: str | None, where: str) -> None:
    """Refuse an SM the base's Triton cannot compile for (its toolchain's ptxas has no target for it)."""
    minimum = SMS[sm].min_triton
    if minimum is None or not triton_version:
        return
    try:
        older = Version(triton_version) < minimum
    except InvalidVersion:
        return  # not a release kiln can compare: the compile says what it thinks
    if older:
        raise KilnError(f"{where}: sm_{sm} needs Triton {minimum} or newer (its ptxas's first with "
                        f"sm_{sm}a); the base carries Triton {triton_version}, which cannot compile for it")


def host_platform(machine: str | None = None) -> str:
    """The platform of this machine (what ``--docker-archive`` and ``context`` build by default)."""
    machine = (machine or _platform.machine()).lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)
    return f"linux/{arch}"
