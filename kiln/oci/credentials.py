"""Registry credentials: explicit environment variables, else the Docker/Podman auth file.

Public API:
    Credentials(username, password)     ``repr``/``str`` never show the password
    find_credentials(registry) -> Credentials | None
    auth_file() -> Path | None          the auth file consulted, for messages

Lookup order for a registry host (``docker.io`` means Docker Hub):
1. ``KILN_REGISTRY_USER`` + ``KILN_REGISTRY_PASSWORD`` (apply to every registry kiln talks to);
2. the auth file: ``$REGISTRY_AUTH_FILE``, else ``$DOCKER_CONFIG/config.json``, else
   ``~/.docker/config.json``: ``credHelpers[host]``, then ``auths[host]`` (base64 ``auth`` or
   ``username``/``password``; an ``identitytoken`` is used as the password with user
   ``<token>``, as Docker does), then ``credsStore`` (``docker-credential-<x> get``).
Docker Hub is stored under ``https://index.docker.io/v1/``; other hosts may appear with a
scheme or a ``/v1/`` suffix, which are ignored when matching.

Secrets never reach messages: errors name the file and the host only, and every password
found is registered with ``kiln.secrets``, so a server that echoes it is scrubbed too.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kiln import lifeline
from kiln.errors import KilnError
from kiln.secrets import register_credentials

_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str = ""  # where they came from, for messages ("KILN_REGISTRY_USER", "~/.docker/config.json")

    def __post_init__(self) -> None:
        register_credentials(self.username, self.password)  # scrubbed from whatever kiln shows

    def __str__(self) -> str:
        return f"user {self.username!r} (from {self.source})" if self.source else f"user {self.username!r}"


def auth_file() -> Path | None:
    explicit = os.environ.get("REGISTRY_AUTH_FILE")
    if explicit:
        return Path(explicit)
    docker_config = os.environ.get("DOCKER_CONFIG")
    path = Path(docker_config) / "config.json" if docker_config else Path.home() / ".docker" / "config.json"
    return path


def find_credentials(registry: str) -> Credentials | None:
    user = os.environ.get("KILN_REGISTRY_USER")
    password = os.environ.get("KILN_REGISTRY_PASSWORD")
    if user and password is not None:
        return Credentials(user, password, "KILN_REGISTRY_USER")
    path = auth_file()
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        raise KilnError(f"{path}: not readable JSON (registry auth file)") from None
    if not isinstance(config, dict):
        raise KilnError(f"{path}: expected a JSON object (registry auth file)")
    keys = _keys_for(registry)
    helpers = config.get("credHelpers") or {}
    for key in keys:
        if key in helpers:
            return _from_helper(helpers[key], registry, path)
    auths = config.get("auths") or {}
    normalised = {_strip_key(k): v for k, v in auths.items()}
    for key in keys:
        entry = auths.get(key) or normalised.get(_strip_key(key))
        if isinstance(entry, dict):
            found = _from_auth_entry(entry, registry, path)
            if found:
                return found
    store = config.get("credsStore")
    if store:
        return _from_helper(store, registry, path, missing_ok=True)
    return None


def _keys_for(registry: str) -> list[str]:
    if registry == "docker.io":
        return list(_HUB_KEYS)
    return [registry, f"https://{registry}", f"http://{registry}"]


def _strip_key(key: str) -> str:
    for prefix in ("https://", "http://"):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    key = key.rstrip("/")
    if key.endswith("/v1") or key.endswith("/v2"):
        key = key[:-3]
    return key


def _from_auth_entry(entry: dict, registry: str, path: Path) -> Credentials | None:
    source = str(path)
    if entry.get("identitytoken"):
        return Credentials("<token>", entry["identitytoken"], source)
    if entry.get("auth"):
        try:
            decoded = base64.b64decode(entry["auth"], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise KilnError(f"{path}: auths entry for {registry} has an 'auth' value that is not base64 of user:password") from None
        user, sep, password = decoded.partition(":")
        if not sep:
            raise KilnError(f"{path}: auths entry for {registry} has an 'auth' value without ':'")
        return Credentials(user, password, source)
    if entry.get("username") and entry.get("password") is not None:
        return Credentials(entry["username"], entry["password"], source)
    return None


def _from_helper(helper: str, registry: str, path: Path, missing_ok: bool = False) -> Credentials | None:
    program = f"docker-credential-{helper}"
    server = "https://index.docker.io/v1/" if registry == "docker.io" else registry
    try:
        result = lifeline.run([program, "get"], input=server, timeout=60)  # dies with the build
    except FileNotFoundError:
        raise KilnError(f"{path}: credential helper {program} (for {registry}) is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise KilnError(f"credential helper {program} did not answer for {registry} within 60 s") from None
    if result.returncode != 0:
        # Helpers say "credentials not found in native keychain" for unknown hosts: not an error
        # for a store consulted as a fallback. Their stderr is not echoed (it may hold secrets).
        if missing_ok:
            return None
        raise KilnError(f"credential helper {program} failed for {registry} (exit {result.returncode})")
    try:
        answer = json.loads(result.stdout)
        user, secret = answer["Username"], answer["Secret"]
    except (ValueError, KeyError, TypeError):
        raise KilnError(f"credential helper {program} gave no Username/Secret JSON for {registry}") from None
    return Credentials(user, secret, program)
