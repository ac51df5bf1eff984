"""Where a registry name is actually contacted: mirrors, Docker Hub's API host, insecure hosts.

Public API:
    Endpoint(registry, host, insecure=False, tls=None)   .scheme -> "https" | "http"
    RegistryConfig(mirrors=None, insecure=None, limits=Limits.from_env())
        .endpoint(registry, push=False) -> Endpoint     mirrors apply to pulls only
        .limits                  timeouts, and for builds the bounds on layers (``kiln.oci.limits``)
        RegistryConfig.load(mirror_options=(), insecure_options=(), path=None, limits=None) -> RegistryConfig
    parse_mirror(text) -> (registry, host, insecure)
    default_config_path() -> Path        $KILN_REGISTRIES, else $XDG_CONFIG_HOME/kiln/registries.toml

A mirror lets a local registry stand in for another one: ``docker.io=127.0.0.1:5000`` sends
every ``docker.io/...`` pull there, keeping the repository path. Pushes never go to a mirror. Without a mirror
``docker.io`` is contacted as ``registry-1.docker.io`` (its API host).

Below kiln's own file and options (which win), containers' ``registries.conf`` (podman's and
skopeo's) adds mirrors and insecure hosts (``kiln.oci.containers_conf`` says which fields).

TLS is verified unless a host is explicitly insecure: listed in ``--insecure-registry`` /
``insecure = [...]``, or a mirror written with ``http://``. An insecure host is contacted over
plain HTTP; written as ``https://host`` it is contacted over HTTPS without certificate
verification (a self-signed registry). No probing: the scheme is what the user wrote.

Config file (TOML; its schema: ``kiln/schemas/registries.schema.json``)::

    insecure = ["127.0.0.1:5000", "https://selfsigned.local:443"]
    [mirrors]
    "docker.io" = "http://127.0.0.1:5000"
    [cache]                                  # build's --cache-from / --cache-to when not given
    from = ["ghcr.io/you/kiln-cache"]
    to = ["ghcr.io/you/kiln-cache"]
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.oci.containers_conf import read_registries_conf, registries_conf_files
from kiln.oci.limits import Limits
from kiln.oci.reference import check_port
from kiln.schema import check

DOCKER_HUB_API = "registry-1.docker.io"
_HOSTPORT = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9A-Fa-f:]+\](?::[0-9]{1,5})?")


@dataclass(frozen=True)
class Endpoint:
    registry: str  # the name in image references, e.g. "docker.io"
    host: str  # host[:port] contacted, e.g. "registry-1.docker.io" or "127.0.0.1:5000"
    insecure: bool = False  # no certificate verification
    tls: bool | None = None  # None: TLS unless insecure

    @property
    def scheme(self) -> str:
        tls = (not self.insecure) if self.tls is None else self.tls
        return "https" if tls else "http"


@dataclass
class RegistryConfig:
    mirrors: dict[str, str] = field(default_factory=dict)
    insecure: set[str] = field(default_factory=set)  # hosts spoken to over plain HTTP
    unverified_tls: set[str] = field(default_factory=set)  # hosts over HTTPS, certificate unchecked
    limits: Limits = field(default_factory=Limits.from_env)  # what every client and build is bounded by
    path: Path | None = None  # the config file read (or looked for): an input no output may replace
    containers_files: list[Path] = field(default_factory=list)  # the registries.conf files read
    cache_from: list[str] = field(default_factory=list)  # [cache] from: REGISTRY/REPO build caches read
    cache_to: list[str] = field(default_factory=list)  # [cache] to: written (checked by ``kiln.image.regcache``)
    cache_require_signed: bool = False  # [cache] require_signed: reading a cache needs --cache-key

    def endpoint(self, registry: str, push: bool = False) -> Endpoint:
        """Where ``registry`` is contacted. Mirrors serve pulls only (containerd's rule): a push
        always goes to the registry named, never to a mirror standing in for it."""
        host = None if push else self.mirrors.get(registry)
        if host is None:
            host = DOCKER_HUB_API if registry == "docker.io" else registry
        if host in self.unverified_tls:
            return Endpoint(registry, host, insecure=True, tls=True)
        return Endpoint(registry, host, host in self.insecure)

    def _add_insecure(self, text: str, where: str) -> None:
        if text.startswith("https://"):
            self.unverified_tls.add(_check_host(text.removeprefix("https://").rstrip("/"), where))
        else:
            self.insecure.add(_check_host(text.removeprefix("http://").rstrip("/"), where))

    @classmethod
    def load(cls, mirror_options: Iterable[str] = (), insecure_options: Iterable[str] = (),
             path: Path | None = None, limits: Limits | None = None) -> RegistryConfig:
        """containers' registries.conf (``kiln.oci.containers_conf``), overlaid with kiln's config
        file (if present), overlaid with command-line options: the later wins."""
        path = path or default_config_path()
        config = cls(limits=limits or Limits.from_env(), path=path)
        shared = read_registries_conf(registries_conf_files())  # podman's and skopeo's file, lowest
        config.mirrors.update(shared.mirrors)
        config.insecure.update(shared.insecure)
        config.containers_files = shared.files
        if path.is_file():
            config._merge_file(path)
        for option in mirror_options:
            registry, host, insecure = parse_mirror(option)
            config.mirrors[registry] = host
            if insecure:
                config.insecure.add(host)
        for host in insecure_options:
            config._add_insecure(host, f"--insecure-registry {host!r}")
        return config

    def _merge_file(self, path: Path) -> None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise KilnError(f"{path}: not valid TOML ({err})") from None
        check(data, "registries", path)  # keys and types (kiln/schemas/registries.schema.json)
        mirrors = data.get("mirrors", {})
        for registry, target in mirrors.items():
            _, host, insecure = parse_mirror(f"{registry}={target}", where=str(path))
            self.mirrors[registry] = host
            if insecure:
                self.insecure.add(host)
        for host in data.get("insecure", []):
            self._add_insecure(host, f"{path}: insecure")
        self.cache_from = list(data.get("cache", {}).get("from", self.cache_from))
        self.cache_to = list(data.get("cache", {}).get("to", self.cache_to))
        self.cache_require_signed = bool(data.get("cache", {}).get("require_signed", self.cache_require_signed))


def parse_mirror(text: str, where: str = "--mirror") -> tuple[str, str, bool]:
    """``docker.io=127.0.0.1:5000`` -> ("docker.io", "127.0.0.1:5000", False); ``http://`` marks insecure."""
    registry, sep, target = text.partition("=")
    registry, target = registry.strip(), target.strip().rstrip("/")
    if not sep or not registry or not target:
        raise KilnError(f"{where} {text!r}: expected REGISTRY=HOST[:PORT], e.g. docker.io=127.0.0.1:5000")
    insecure = target.startswith("http://")
    target = target.removeprefix("http://").removeprefix("https://")
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = "docker.io"
    _check_host(registry, f"{where} {text!r}")
    return registry, _check_host(target, f"{where} {text!r}"), insecure


def default_config_path() -> Path:
    explicit = os.environ.get("KILN_REGISTRIES")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path.home() / ".config"
    return base / "kiln" / "registries.toml"


def _check_host(host: str, where: str) -> str:
    if not _HOSTPORT.fullmatch(host):
        raise KilnError(f"{where}: {host!r} is not a host[:port]")
    problem = check_port(host)
    if problem:
        raise KilnError(f"{where}: {problem}")
    return host
