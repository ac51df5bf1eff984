"""Image references as users type them, and the OCI names they are made of.

Public API:
    ImageReference(registry, repository, tag, digest)  -- a registry image, normalised
        .ref -> str             the tag or digest to ask the registry for (digest wins)
        .pinned(digest) -> ImageReference   the same image addressed by digest
        str(ref)                canonical form, e.g. ``docker.io/vllm/vllm-openai:v0.20.1``
    parse_reference(text) -> ImageReference
    check_port(host) -> str | None    what is wrong with ``host[:port]``'s port (1..65535)
    check_tag(tag, where) -> str   a tag (or a pin name, which becomes part of one) by the grammar

Normalisation follows Docker's rules so a reference means the same image it means to
``docker pull``: a first path component is a registry host only if it contains ``.`` or ``:``
or is ``localhost``; otherwise the registry is ``docker.io`` and one-component names get the
``library/`` prefix; no tag and no digest means ``latest``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kiln.errors import KilnError

DOCKER_HUB = "docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io"}

# Grammar from the distribution reference spec (lower-case path components joined by
# '.', '_', '__' or runs of '-'; tags up to 128 word characters, '.' and '-').
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?|\[[0-9A-Fa-f:]+\](?::[0-9]+)?")


def check_port(host: str) -> str | None:
    """What is wrong with the port of ``host[:port]`` (None when it has none or a valid one).

    A TCP port is 1..65535; urllib3 refuses any other only when the first request is made,
    with a traceback, after the build's work."""
    head, sep, port = host.rpartition(":")
    if not sep or (head.count(":") and not head.endswith("]")):  # no port, or a bare IPv6 address
        return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"port {port!r} of {host!r} is not a TCP port (1 to 65535)"
    return None


def check_tag(tag: str, where: str) -> str:
    """``tag`` if it is a valid OCI tag, else an error saying ``{where} is not a valid tag``."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise KilnError(f"{where} is not a valid OCI tag (letters, digits, '_', '.', '-'; at most 128, "
                        "not starting with '.' or '-')")
    return tag


@dataclass(frozen=True)
class ImageReference:
    registry: str  # "docker.io", "ghcr.io", "127.0.0.1:5000"
    repository: str  # "vllm/vllm-openai", "library/ubuntu"
    tag: str | None = None
    digest: str | None = None  # "sha256:<64 hex>"

    @property
    def ref(self) -> str:
        """What the manifest endpoint is asked for: the digest when known, else the tag."""
        return self.digest or self.tag or "latest"

    def pinned(self, digest: str) -> ImageReference:
        """This image addressed by ``digest`` (the tag is kept for display)."""
        if not _DIGEST.fullmatch(digest):
            raise KilnError(f"{self}: {digest!r} is not a sha256 digest")
        return replace(self, digest=digest)

    @property
    def name(self) -> str:
        """``registry/repository`` without tag or digest."""
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        text = self.name
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> ImageReference:
    """Parse ``[host[:port]/]path[:tag][@sha256:hex]`` with Docker's normalisation."""
    original = text
    text = text.strip()
    if not text or any(c.isspace() for c in text):
        raise KilnError(f"image reference {original!r}: empty or contains whitespace")
    if "://" in text:
        raise KilnError(f"image reference {original!r}: references carry no URL scheme (docker://REF is a transport)")
    digest = None
    if "@" in text:
        text, digest = text.rsplit("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise KilnError(f"image reference {original!r}: {digest!r} is not a sha256:<64 hex> digest")
    tag = None
    last_slash = text.rfind("/")
    colon = text.rfind(":")
    if colon > last_slash:  # a colon after the last slash is a tag, not a port
        text, tag = text[:colon], text[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise KilnError(f"image reference {original!r}: {tag!r} is not a valid tag")
    parts = text.split("/")
    first = parts[0]
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, path = first, parts[1:]
        if not _HOST.fullmatch(registry):
            raise KilnError(f"image reference {original!r}: {registry!r} is not a registry host")
        port_problem = check_port(registry)
        if port_problem:
            raise KilnError(f"image reference {original!r}: {port_problem}")
    else:
        registry, path = DOCKER_HUB, parts
    if registry.lower() in _HUB_ALIASES:
        registry = DOCKER_HUB
        if len(path) == 1:
            path = ["library", *path]
    for component in path:
        if not _COMPONENT.fullmatch(component):
            raise KilnError(
                f"image reference {original!r}: repository component {component!r} must be "
                "lower-case letters, digits and single separators"
            )
    if not tag and not digest:
        tag = "latest"
    return ImageReference(registry=registry, repository="/".join(path), tag=tag, digest=digest)
