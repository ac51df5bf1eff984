"""Mirrors and insecure hosts from containers' ``registries.conf`` (what podman and skopeo read).

Public API:
    registries_conf_files() -> list[Path]     the files podman would read, in loading order
    read_registries_conf(files) -> ContainersRegistries   mirrors {registry: host}, insecure {host}

Files (containers-registries.conf(5), containers-registries.conf.d(5)): ``$CONTAINERS_REGISTRIES_CONF``
alone when set; else ``~/.config/containers/registries.conf`` if it exists, else
``/etc/containers/registries.conf``; then the ``*.conf`` drop-ins, in name order, of
``/etc/containers/registries.conf.d`` (unless the user's file was loaded) and of
``~/.config/containers/registries.conf.d``. A later ``[[registry]]`` with the same prefix replaces
an earlier one.

The file belongs to every container tool, so kiln refuses only what it cannot parse as TOML, or a
field it reads with the wrong type; it ignores the rest. It reads (version 2 format):

    [[registry]]  prefix (default: location), location, insecure
    [[registry.mirror]]  location, insecure     the first usable mirror of a registry; pulls only
    [registries.insecure] registries = [...]     (version 1 format)

A registry entry applies when its prefix is a whole registry (``host[:port]``, no path, no
wildcard) and its location is the prefix itself (a ``location`` rewriting a registry would also
move pushes; kiln does not follow it). A mirror applies when its location is a ``host[:port]``
(kiln keeps the repository path). ``insecure = true`` makes that host plain HTTP for every command,
push included (containers' tools would also try HTTPS first; kiln never probes). ``blocked``,
``unqualified-search-registries``, short-name aliases, ``pull-from-mirror`` and the rest are ignored.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError

SYSTEM_CONF = Path("/etc/containers/registries.conf")
_HOSTPORT = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9A-Fa-f:]+\](?::[0-9]{1,5})?")
_DOCKER_HUB_ALIASES = {"index.docker.io": "docker.io", "registry-1.docker.io": "docker.io"}


@dataclass
class ContainersRegistries:
    mirrors: dict[str, str] = field(default_factory=dict)  # registry -> mirror host[:port]
    insecure: set[str] = field(default_factory=set)  # hosts spoken to over plain HTTP
    files: list[Path] = field(default_factory=list)  # the files read


def _user_containers_dir() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "containers"


def registries_conf_files(system: Path = SYSTEM_CONF) -> list[Path]:
    explicit = os.environ.get("CONTAINERS_REGISTRIES_CONF")
    if explicit:
        return [Path(explicit)] if Path(explicit).is_file() else []
    user = _user_containers_dir() / "registries.conf"
    main = user if user.is_file() else system
    files = [main] if main.is_file() else []
    dirs = [] if user.is_file() else [system.with_name("registries.conf.d")]
    dirs.append(_user_containers_dir() / "registries.conf.d")
    for directory in dirs:
        if directory.is_dir():
            files += sorted(p for p in directory.glob("*.conf") if p.is_file())
    return files


def read_registries_conf(files: list[Path]) -> ContainersRegistries:
    entries: dict[str, dict] = {}  # prefix -> the last [[registry]] table with it
    result = ContainersRegistries(files=list(files))
    for path in files:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise KilnError(f"{path}: not a registries.conf kiln can read ({err})") from None
        v1 = data.get("registries", {})
        insecure_v1 = v1.get("insecure", {}) if isinstance(v1, dict) else {}
        hosts = insecure_v1.get("registries", []) if isinstance(insecure_v1, dict) else []
        for host in _typed(hosts, list, path, "registries.insecure.registries"):
            if isinstance(host, str) and _HOSTPORT.fullmatch(host):
                result.insecure.add(host)
        for index, entry in enumerate(_typed(data.get("registry", []), list, path, "registry")):
            where = f"registry[{index}]"
            entry = _typed(entry, dict, path, where)
            location = _typed(entry.get("location", ""), str, path, f"{where}.location")
            prefix = _typed(entry.get("prefix", "") or location, str, path, f"{where}.prefix")
            entries[prefix] = {"path": path, "where": where, **entry, "location": location or prefix}
    for prefix, entry in entries.items():
        _apply(result, prefix, entry)
    return result


def _apply(result: ContainersRegistries, prefix: str, entry: dict) -> None:
    path, where = entry["path"], entry["where"]
    registry = _DOCKER_HUB_ALIASES.get(prefix, prefix)
    if not _HOSTPORT.fullmatch(prefix) or entry["location"].rstrip("/") != prefix:
        return  # a repository prefix, a wildcard, or a rewritten location: not kiln's to follow
    if _typed(entry.get("insecure", False), bool, path, f"{where}.insecure"):
        result.insecure.add(prefix)
    for number, mirror in enumerate(_typed(entry.get("mirror", []), list, path, f"{where}.mirror")):
        mirror = _typed(mirror, dict, path, f"{where}.mirror[{number}]")
        host = _typed(mirror.get("location", ""), str, path, f"{where}.mirror[{number}].location").rstrip("/")
        if not _HOSTPORT.fullmatch(host):
            continue  # a mirror under a repository path: kiln keeps the path, so it cannot use it
        result.mirrors.setdefault(registry, host)
        if _typed(mirror.get("insecure", False), bool, path, f"{where}.mirror[{number}].insecure"):
            result.insecure.add(host)


def _typed(value, kind: type, path: Path, name: str):
    if not isinstance(value, kind):
        raise KilnError(f"{path}: {name} must be a {'table' if kind is dict else kind.__name__}, "
                        f"not {type(value).__name__}")
    return value
