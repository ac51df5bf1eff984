"""Lock pins to their base image's digest (``build.py pin lock``).

Public API:
    LockResult(name, image, digest, previous, error, platforms, previous_platforms)
        .status -> "unchanged" | "locked" | "re-locked" | "completed" (the digest as it was, its
                   platforms recorded now) | "kept" (locked, not re-checked) | "failed"
    resolve_pin(pin, config) -> str             the digest the pin's ``image`` names now
    resolve_platforms(pin, config, clients=None) -> (digest, {platform: manifest digest})
    lock_pins(path, names, config) -> list[LockResult]   resolve each, then rewrite ``pins.toml``
    write_digests(path, digests, platforms=None)   the tomlkit writer (comments and order kept)

A lock resolves the reference exactly as ``build`` does (one manifest HEAD through the same
registry client, mirrors and insecure hosts), so a freshly locked pin builds without
``--allow-unlocked``. For a manifest list / OCI index the digest is the index's, as the build
checks it, and beside it ``platforms``: each platform's image manifest digest, read from the
index (one more manifest GET; a single-manifest base: its config's platform, one blob GET), so a
build for a platform the base lacks fails before any request. Every pin named is resolved before anything is written, each on its own: a pin whose
image cannot be resolved (a missing tag, an unreachable registry) is a ``failed`` result when it
was unlocked, ``kept`` (its digest as it was, a warning) when it was locked, and the others are
still locked. The file is then rewritten once, with tomlkit (comments, order and
formatting kept), to a temporary file beside it, checked by ``load_pins`` and renamed over the
original. A bad pins file or an unknown pin name is an error before any request, and leaves the
file untouched; a lock that changes nothing does not rewrite it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomlkit

from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.oci.blobcache import BlobCache
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import RemoteImage
from kiln.oci.reference import parse_reference
from kiln.oci.registry import RegistryClient
from kiln.pins import Pin, get_pin, load_pins
from kiln.staging import write_atomic


@dataclass(frozen=True)
class LockResult:
    name: str
    image: str
    digest: str
    previous: str  # "" when the pin was unlocked
    error: str = ""  # why the pin could not be resolved; then digest is "" and nothing is written for it
    platforms: dict[str, str] = field(default_factory=dict)  # "linux/amd64" -> its manifest digest
    previous_platforms: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.error:
            # a pin already locked keeps its lock when it cannot be checked now (Docker Hub out of
            # reach): it is still locked, and builds as it did; only an unlocked one failed
            return "kept" if self.previous else "failed"
        if self.previous == self.digest:
            # a pin locked before platforms were recorded: the same base, its platforms written now
            return "unchanged" if self.previous_platforms == self.platforms else "completed"
        return "re-locked" if self.previous else "locked"

    @property
    def changed(self) -> bool:
        return self.status in ("locked", "re-locked", "completed")

    def to_json(self) -> dict:
        return {**asdict(self), "error": self.error or None, "status": self.status}


def resolve_pin(pin: Pin, config: RegistryConfig, clients: dict | None = None) -> str:
    """The manifest digest ``pin.image`` names now; errors name the pin."""
    try:
        ref = parse_reference(pin.image)
        clients = {} if clients is None else clients
        host = config.endpoint(ref.registry).host
        client = clients.get(host) or clients.setdefault(host, RegistryClient.for_registry(ref.registry, config))
        digest = client.resolve(ref.repository, ref.ref)
        if ref.digest and digest != ref.digest:
            raise KilnError(f"{pin.image} answers with digest {digest}")
        return digest
    except KilnError as err:
        raise KilnError(f"pin {pin.name}: {err}") from None


def resolve_platforms(pin: Pin, config: RegistryConfig, clients: dict | None = None) -> tuple[str, dict[str, str]]:
    """The digest ``pin.image`` names now and each platform's image manifest digest under it."""
    clients = {} if clients is None else clients
    digest = resolve_pin(pin, config, clients)
    ref = parse_reference(pin.image)
    client = clients[config.endpoint(ref.registry).host]
    try:
        image = RemoteImage(ref.pinned(digest), client, BlobCache(cache_root() / "blobs"))
        platforms = image.platforms()
    except KilnError as err:
        raise KilnError(f"pin {pin.name}: {err}") from None
    if not platforms:
        raise KilnError(f"pin {pin.name}: {pin.image}@{digest} lists no image for any platform")
    return digest, dict(sorted(platforms.items()))


def lock_pins(path: Path, names: list[str], config: RegistryConfig) -> list[LockResult]:
    """Resolve the named pins (every GPU pin when ``names`` is empty) and write the digests resolved."""
    pins = load_pins(path)
    # The CPU pin's base is built by ci/cpu_base.py, not pulled: ci/serve_check locks it per run.
    chosen = ([get_pin(pins, name, path) for name in dict.fromkeys(names)] if names
              else [p for p in pins.values() if not p.cpu])
    clients: dict = {}
    results = []
    for pin in chosen:
        previous = dict(pin.platforms)
        try:
            digest, platforms = resolve_platforms(pin, config, clients)
            results.append(LockResult(pin.name, pin.image, digest, pin.digest, platforms=platforms,
                                      previous_platforms=previous))
        except KilnError as err:
            results.append(LockResult(pin.name, pin.image, "", pin.digest, str(err), previous_platforms=previous))
    changed = [r for r in results if r.changed]
    if changed:
        write_digests(path, {r.name: r.digest for r in changed}, {r.name: r.platforms for r in changed})
    return results


def write_digests(path: Path, digests: dict[str, str], platforms: dict[str, dict[str, str]] | None = None) -> None:
    """Set ``pins.<name>.digest`` (and ``platforms``, when given) for each entry, keeping
    everything else byte-for-byte. A pin given a digest without platforms loses any it had:
    they were another base's."""
    target = path.resolve()
    text = target.read_text()
    try:
        document = tomlkit.parse(text)
    except tomlkit.exceptions.TOMLKitError as err:
        raise KilnError(f"{path}: not valid TOML: {err}") from None
    platforms = platforms or {}
    for name, digest in digests.items():
        entry = document["pins"][name]
        entry["digest"] = digest
        if platforms.get(name):
            table = tomlkit.inline_table()
            table.update(dict(sorted(platforms[name].items())))
            if "platforms" in entry:
                entry["platforms"] = table
            else:  # on the line after digest, not after the comments that end the table
                entry.value._insert_after("digest", "platforms", table)
        elif "platforms" in entry:
            del entry["platforms"]

    def check(staged: Path) -> None:  # never install a file kiln could not read back
        written = load_pins(staged)
        for name, digest in digests.items():
            if written[name].digest != digest or dict(written[name].platforms) != platforms.get(name, {}):
                raise KilnError(f"{path}: pins.{name}.digest did not round-trip")

    write_atomic(target, tomlkit.dumps(document).encode(), check)
