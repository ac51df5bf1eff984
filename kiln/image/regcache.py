"""A build cache in a registry, shared across machines: ``build --cache-to/--cache-from REGISTRY/REPO``.

Public API:
    RECORD_MEDIA_TYPE, SIGNED_RECORD_MEDIA_TYPE
    parse_cache_location(text, where) -> ImageReference     ``REGISTRY/REPO``, no tag or digest
    CacheUse(kind, key, inputs, sm)  one entry a build looks up: hit or not, what it would write
    CachedEntry(record, layers, where)                       a verified entry: its layers as ``LayerContents``
    read_entry(client, repository, kind, key, key_inputs, workdir, reporter=SILENT, open_record=plain_record,
               agrees=None) -> CachedEntry | None
    verify_entry(client, repository, manifest, kind, key, key_inputs, workdir, reporter=SILENT,
                 open_record=plain_record, agrees=None) -> CachedEntry | None    the same, of a manifest already found
    plain_record(data, media_type, where) -> bytes   the record of an unsigned entry (a signed one: a miss)
    patched_agrees(key_inputs, platform) -> (CachedEntry -> None)   a patched entry against what the build knows
                                                     (keyed by source: its source; else the base's platform)
    SITE_DIR                                         the site dirs the layer walk finds vLLM in
    entry_record(use, layers) -> dict
    write_entry(client, repository, kind, key, record, layers, seal=None) -> str (the entry's manifest digest)

What a build computes from the base's layers is cached by a key of the inputs each part
depends on (``kiln.image.cachekeys``: the vLLM layers the walk reads, not the base's digest,
so a base rebuilt below them shares its entries). Three kinds of entry (and the Triton wheel's,
``kiln.image.wheelcache``, and the warm layer's, ``kiln.image.warmcache``):

* ``patched``: the patching's result: every verdict, the changed modules and the whiteouts of
  their stale bytecode (one layer), vLLM's version and site dir, each changed file's pristine
  sha256, the source it was made of; written under two keys (by the layers a probe finds it by,
  and by its pristine files, which every platform and SM of a pin shares: one layer blob). The image's patched-source layer (with its baked files and audit file) is
  assembled from it by each build.
* ``kernels``: one SM's Triton kernel layer (or none, left out) and its summary and env.
* ``catalogue``: the patch catalogue's facts (``kiln.patch.facts``), no layer: what a build
  whose other entries all hit takes from the catalogue without importing a patch module.

How a build finds them (the ``patched`` entry by probing the depths the vLLM layers may
have, before any is read): ``kiln.image.cachelookup``. An entry is an OCI artifact manifest
(``artifactType`` per kind) tagged by its kind and key in the cache repository: its config is
the record (the kind, the key and the inputs it hashes, the kind's fields, its layers'
digests, removals and history), its layers are the blobs. Written with a signing key
(``build --sign-key``), the config is instead a DSSE envelope of the record (``seal``,
``kiln.attest.dsse``), and a reader given the public key (``--cache-key``) takes only entries
whose signature verifies: the record names every layer by digest, so the signature covers
the whole entry.

Reading verifies everything: the manifest's and every blob's digest and size; the record's
kind, key and inputs equal the ones this build computed (an entry copied under another key is
refused; the inputs name the vLLM layers, so an entry is used only on a base whose walk reads
exactly them); the layers re-derive: their contents written again by ``kiln.oci.layer`` give
the recorded digest and diff_id, so what the build bakes from them is byte for byte the entry.
Then every fact the build knows without the entry is compared with it (``agrees``; for a
patched entry ``patched_agrees``: outcomes, module hashes, applied patches, gates, changed
files, vLLM version, site dir (``SITE_DIR``), platform or source; docs/ARCHITECTURE.md). An
unsigned entry is trusted to whoever can push to the cache repository: these checks catch an
entry of another build re-keyed, or a record that lies about where the modules go, but not
patched bytes rewritten together with the sha256 the record gives them (``docs/TRUST.md``).
Anything wrong is a miss with a warning, never an image; a miss of one entry leaves the other
usable. Concurrent writers of one key are safe (blobs before the manifest; the last PUT wins,
and any writer's entry gives the same image: docs/ARCHITECTURE.md, "The registry build cache").
"""

from __future__ import annotations

import json
import posixpath
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.image.cachekeys import (
    ARTIFACT_TYPES,
    CATALOGUE,
    KERNELS,
    PATCHED,
    WARM,
    canonical,
    entry_tag,
)
from kiln.oci.digest import sha256_digest, sha256_text
from kiln.oci.layer import WHITEOUT_PREFIX, Layer, LayerContents, write_layer
from kiln.oci.manifest import Descriptor, Manifest
from kiln.oci.mediatypes import OCI_LAYER_GZIP, OCI_MANIFEST
from kiln.oci.reference import ImageReference, parse_reference
from kiln.oci.registry import RegistryClient
from kiln.patch.outcome import Outcome, Verdict
from kiln.report import SILENT, Reporter

RECORD_MEDIA_TYPE = "application/vnd.kiln.cache.record.v1+json"
SIGNED_RECORD_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"  # its payload: a record
KEY_ANNOTATION = "dev.kiln.cache.key"
_RECORD_MAX = 16 << 20  # a record is verdicts and digests: kilobytes
_UNPACKED_MAX = 4 << 30  # what one cached layer may inflate to before it is refused
# where the layer walk (``kiln.source.layerwalk``) finds vLLM: a site dir, relative, no ``.``/``..``
SITE_DIR = re.compile(r"(?:(?!\.{1,2}/)[^/]+/)*lib/python3(?:\.\d+)?/(?:dist|site)-packages")


def parse_cache_location(text: str, where: str) -> ImageReference:
    """``REGISTRY/REPO`` (BuildKit's ``type=registry,ref=`` without the tag: entries are tagged by key)."""
    try:
        ref = parse_reference(text)
    except KilnError as err:
        raise KilnError(f"{where}: {err}") from None
    if ref.digest or ref.tag != "latest" or text.endswith(":latest") or "/" not in text:
        raise KilnError(f"{where}: {text!r} must be REGISTRY/REPOSITORY, without a tag or digest "
                        "(entries are tagged by their key)")
    return ImageReference(ref.registry, ref.repository)


@dataclass
class CacheUse:
    """One entry a build looks up (``hit``: where it was read from) and would write: its record's
    own fields and its layers' contents, set by the build."""

    kind: str
    key: str
    inputs: dict
    sm: int | None = None
    hit: str | None = None  # registry/repository:tag of the entry used
    writable: bool = True  # False: no lookup would find it (``kiln.image.cachelookup``), so none is written
    location: ImageReference | None = None  # the cache repository it was read from
    fields: dict = field(default_factory=dict)
    contents: list[LayerContents] = field(default_factory=list)
    source: tuple[str, dict] | None = None  # a patched entry's key by its source (``source_key``): written too
    shared: str | None = None  # the platform of this tag whose patch run this one reused

    def to_json(self) -> dict:
        out = {"kind": self.kind, "key": self.key, "tag": entry_tag(self.kind, self.key), "hit": self.hit}
        if self.sm is not None:
            out["sm"] = self.sm
        if self.source is not None:
            out["source_key"] = self.source[0]
        if self.shared is not None:
            out["shared"] = self.shared
        return out


@dataclass
class CachedEntry:
    """A verified entry: its record and layers, ready to bake (the same bytes as the entry's)."""

    record: dict
    layers: list[LayerContents]
    where: str  # registry/repository:tag it was read from
    signed: bool = False  # its record's signature verified with the reader's key (``--cache-key``)

    @property
    def outcomes(self) -> dict[str, Outcome]:
        out = {}
        for data in self.record["outcomes"]:
            files = {rel: (v["before"], v["after"]) for rel, v in data.get("files", {}).items()} or None
            out[data["patch"]] = Outcome(data["patch"], Verdict(data["verdict"]), data.get("detail", ""), files)
        return out

    def changed(self) -> dict[str, str]:
        """A patched entry's changed modules: vllm-relative path -> text."""
        prefix = f"{self.record['site_dir']}/vllm/"
        return {path[len(prefix):]: data.decode("utf-8") for path, data in self.layers[0].files.items()}


def entry_record(use: CacheUse, layers: list[Layer]) -> dict:
    """What a hit needs: the use's fields, and each layer's digests, history line and removals."""
    return {
        "kind": use.kind, "key": use.key, "inputs": use.inputs, **use.fields,
        "layers": [{"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size,
                    "created_by": contents.created_by, "removals": list(contents.removals)}
                   for layer, contents in zip(layers, use.contents, strict=True)],
    }


def plain_record(data: bytes, media_type: str, where: str) -> bytes:
    """The record of an unsigned entry; a signed one needs an opener that checks it (a miss here)."""
    if media_type != RECORD_MEDIA_TYPE:
        raise KilnError(f"its config is {media_type}, not an unsigned kiln cache record")
    return data


def write_entry(client: RegistryClient, repository: str, kind: str, key: str, record: dict, layers: list[Layer],
                seal: Callable[[bytes], bytes] | None = None) -> str:
    """Upload the layers and the record (unless present), then PUT the entry's manifest under its tag.

    ``seal``: the record's bytes -> a DSSE envelope of them (signed)."""
    record_bytes = canonical(record)
    media_type = RECORD_MEDIA_TYPE
    if seal is not None:
        record_bytes, media_type = seal(record_bytes), SIGNED_RECORD_MEDIA_TYPE
    record_digest = sha256_digest(record_bytes)
    for layer in layers:
        if not client.blob_exists(repository, layer.digest):
            client.upload_blob(repository, layer.digest, layer.path)
    if not client.blob_exists(repository, record_digest):
        client.upload_blob(repository, record_digest, record_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPES[kind],
        "config": {"mediaType": media_type, "digest": record_digest, "size": len(record_bytes)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": layer.digest, "size": layer.size} for layer in layers],
        "annotations": {KEY_ANNOTATION: key},
    }
    return client.put_manifest(repository, entry_tag(kind, key), canonical(manifest), OCI_MANIFEST)


def read_entry(client: RegistryClient, repository: str, kind: str, key: str, key_inputs: dict, workdir: Path,
               reporter: Reporter = SILENT, open_record: Callable[[bytes, str, str], bytes] = plain_record,
               agrees: Callable[[CachedEntry], None] | None = None) -> CachedEntry | None:
    """The ``kind`` entry of ``key``, verified; None (a miss) when there is none or it is not right (with a warning).

    ``agrees``: raises KilnError naming the field where the entry differs from what the build knows."""
    tag = entry_tag(kind, key)
    try:
        manifest = client.find_manifest(repository, tag)
    except KilnError as err:
        reporter.warn(f"build cache entry {client.endpoint.registry}/{repository}:{tag} refused, "
                      f"building without it: {err}")
        return None
    if manifest is None:
        reporter.note(f"build cache {client.endpoint.registry}/{repository}: no {kind} entry for this build")
        return None
    return verify_entry(client, repository, manifest, kind, key, key_inputs, workdir, reporter, open_record, agrees)


def verify_entry(client: RegistryClient, repository: str, manifest: Manifest, kind: str, key: str, key_inputs: dict,
                 workdir: Path, reporter: Reporter = SILENT,
                 open_record: Callable[[bytes, str, str], bytes] = plain_record,
                 agrees: Callable[[CachedEntry], None] | None = None) -> CachedEntry | None:
    """The entry ``manifest`` (found under ``key``'s tag), verified; None (a miss, with a warning) when not right.

    The entry is ``signed`` when ``open_record`` checks signatures (its ``verifies`` attribute):
    a record it opens is one its key signed."""
    where = f"{client.endpoint.registry}/{repository}:{entry_tag(kind, key)}"
    try:
        entry = _verified(client, repository, manifest, kind, key, key_inputs, workdir, where, open_record)
        entry.signed = bool(getattr(open_record, "verifies", False))
        if agrees is not None:
            agrees(entry)
        return entry
    except KilnError as err:
        reporter.warn(f"build cache entry {where} refused, building without it: {err}")
        return None


def _verified(client: RegistryClient, repository: str, manifest: Manifest, kind: str, key: str, key_inputs: dict,
              workdir: Path, where: str, open_record: Callable[[bytes, str, str], bytes]) -> CachedEntry:
    body = manifest.json
    if body.get("artifactType") != ARTIFACT_TYPES[kind]:
        raise KilnError(f"not a kiln {kind} cache entry (artifactType {body.get('artifactType')!r})")
    config = Descriptor.from_json(body.get("config"), f"{where} config")
    if config.media_type not in (RECORD_MEDIA_TYPE, SIGNED_RECORD_MEDIA_TYPE) or config.size > _RECORD_MAX:
        raise KilnError(f"its config is not a kiln cache record ({config.media_type}, {config.size} bytes)")
    chunks = []
    with client.open_blob(repository, config.digest, config.size) as reader:  # longer than its size: refused
        while chunk := reader.read(1 << 20):
            chunks.append(chunk)
    data = b"".join(chunks)
    try:
        record = json.loads(open_record(data, config.media_type, f"{where} record"))
    except ValueError:
        raise KilnError("its record is not JSON") from None
    if not isinstance(record, dict) or record.get("kind") != kind or record.get("key") != key \
            or record.get("inputs") != key_inputs:
        raise KilnError("its record is another build's (kind, key or inputs differ from this build's)")
    descriptors = [Descriptor.from_json(d, f"{where} layer") for d in body.get("layers") or []]
    recorded = record.get("layers")
    if not isinstance(recorded, list) or [(d.digest, d.size) for d in descriptors] != \
            [(r.get("digest"), r.get("size")) for r in recorded if isinstance(r, dict)]:
        raise KilnError("its layers are not the ones its record lists")
    if len(descriptors) not in _LAYER_COUNTS[kind]:
        raise KilnError(f"a {kind} entry with {len(descriptors)} layers")
    contents = []
    for descriptor, layer in zip(descriptors, recorded, strict=True):
        path = workdir / descriptor.digest.split(":", 1)[1]
        with client.open_blob(repository, descriptor.digest, descriptor.size) as reader, path.open("wb") as out:
            while chunk := reader.read(1 << 20):
                out.write(chunk)
        layer_contents = _unpacked(path, str(layer.get("created_by", "")), layer.get("removals") or [])
        again = write_layer(layer_contents, workdir / "check")
        if (again.digest, again.diff_id) != (descriptor.digest, layer.get("diff_id")):
            raise KilnError(f"layer {descriptor.digest} does not re-derive from its contents")
        again.path.unlink()
        path.unlink()
        contents.append(layer_contents)
    entry = CachedEntry(record, contents, where)
    _check_fields(kind, entry)
    return entry


# how many layers an entry of each kind has: a patched entry its changed modules; a kernels
# entry one SM's kernel layer, or none when it was left out; a catalogue entry none; a warm entry its layer
_LAYER_COUNTS = {PATCHED: (1,), KERNELS: (0, 1), CATALOGUE: (0,), WARM: (1,)}
_FIELDS = {PATCHED: {"outcomes": list, "applied": list, "vllm_version": str, "site_dir": str, "before": dict,
                     "modules": dict, "platform": dict, "source": dict},
           KERNELS: {"env": dict, "triton": dict}, CATALOGUE: {"facts": dict}, WARM: {"bundle": str}}


def _check_fields(kind: str, entry: CachedEntry) -> None:
    """Every field a hit uses, of the type it is used as: a record a build could not use is a miss."""
    record = entry.record
    for name, expected in _FIELDS[kind].items():
        if not isinstance(record.get(name), expected):
            raise KilnError(f"its record's {name!r} is not a {expected.__name__}")
    if kind in (CATALOGUE, WARM):  # parsed where they are used (``kiln.patch.facts``, ``kiln.image.warmcache``)
        return
    if kind == KERNELS:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in record["env"].items()):
            raise KilnError("its record's env is not strings")
        return
    if not all(isinstance(pid, str) for pid in record["applied"]):
        raise KilnError("its record's applied patches are not strings")
    try:
        entry.outcomes  # noqa: B018 - each verdict parses
        changed = entry.changed()
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise KilnError(f"its record's outcomes or its layer's files do not parse ({err!r})") from None
    prefix = f"{record['site_dir']}/vllm/"
    if not all(path.startswith(prefix) and posixpath.normpath(path) == path and ".." not in path.split("/")
               for path in entry.layers[0].files):
        raise KilnError(f"its layer holds files outside {prefix}")
    if not set(record["before"]) <= set(changed) or \
            not all(isinstance(v, str) for v in record["before"].values()):
        raise KilnError("its record's 'before' is not a sha256 per changed file")


def base_platform(config: dict) -> dict:
    """What a base's config says of its platform (a patched record carries its writer's)."""
    return {name: config.get(name) for name in ("os", "architecture", "variant")}


def patched_agrees(key_inputs: dict, platform: dict) -> Callable[[CachedEntry], None]:
    """The check of a verified ``patched`` entry against what the build knows without it: the
    selection its key covers (``key_inputs``: ``kiln.image.cachekeys.patched_key``'s, this build's
    own) and the base's ``platform`` (``base_platform``). Raises KilnError naming the field."""

    def check(entry: CachedEntry) -> None:
        record = entry.record
        patches = key_inputs["patches"]
        if not SITE_DIR.fullmatch(record["site_dir"]):
            raise KilnError(f"its record's site_dir {record['site_dir']!r} is not a Python site dir "
                            "the base's vLLM could be in (…/lib/python3.N/site-packages or dist-packages)")
        if record["vllm_version"] != key_inputs["vllm"]:
            raise KilnError(f"its record's vllm_version {record['vllm_version']!r} is not the pin's "
                            f"{key_inputs['vllm']!r}")
        source = record["source"]  # what its writer's walk read (``cachekeys.source_identity``)
        if "source" in key_inputs:  # keyed by its pristine files: any platform's, this source's
            if source != key_inputs["source"]:
                raise KilnError("its record's source is not the one its key names")
        elif record["platform"] != platform:
            raise KilnError(f"its record's platform {record['platform']} is not the base's {platform}")
        files = source.get("files")
        if source.get("site_dir") != record["site_dir"] or not isinstance(files, dict) or any(
                files.get(rel) != sha for rel, sha in record["before"].items()):
            raise KilnError("its record's site dir or pristine files are not those its source names")
        outcomes = entry.outcomes
        ids = [p["id"] for p in patches]
        if list(outcomes) != ids:
            raise KilnError(f"its record's outcomes are of {_listed(outcomes, 'no patch')}; the selection "
                            f"its key covers is {_listed(ids, 'no patch')}")
        modules = {p["id"]: p["sha256"] for p in patches}
        if record["modules"] != modules:
            wrong = next((pid for pid in modules if record["modules"].get(pid) != modules[pid]),
                         next(iter(set(record["modules"]) - set(modules)), None))
            raise KilnError(f"its record's modules: {_listed([str(wrong)])}'s sha256 is not the selection's")
        applied = [pid for pid, o in outcomes.items() if o.verdict is Verdict.APPLIES]
        if record["applied"] != applied:
            raise KilnError(f"its record's applied patches ({_listed(record['applied'])}) are not "
                            f"those its outcomes apply ({_listed(applied)})")
        for patch in patches:
            verdict = outcomes[patch["id"]].verdict
            if verdict.ok and (patch["out_of_range"] or patch["gated"]):
                raise KilnError(f"its record's outcomes: {patch['id']} is {verdict}, but this target "
                                f"{'puts it out of range' if patch['out_of_range'] else 'gates it off'}")
            if verdict.blocks_build:
                raise KilnError(f"its record's outcomes: {patch['id']} is {verdict}, which no build writes")
        made: dict[str, set] = {}  # rel path -> what the applied patches say they made of it
        for outcome in outcomes.values():
            if outcome.verdict is Verdict.APPLIES:
                for rel, (_, after) in (outcome.files or {}).items():
                    made.setdefault(rel, set()).add(after)
        changed = entry.changed()
        if set(changed) != set(made):
            raise KilnError(f"its layer's files ({_listed(sorted(changed))}) are not those its "
                            f"applied patches changed ({_listed(sorted(made))})")
        for rel, text in changed.items():
            if sha256_text(text) not in made[rel]:
                raise KilnError(f"its layer's {_listed([rel])} is not what its outcomes say the patching made of it")

    return check


def _listed(names, none: str = "none") -> str:
    """Names a record gives, for a one-line warning: any with a control character quoted."""
    return ", ".join(name if name.isprintable() else repr(name) for name in names) or none


def _unpacked(path: Path, created_by: str, removals: list) -> LayerContents:
    """A kiln layer's files and whiteouts, read back (only what ``write_layer`` writes is accepted)."""
    files: dict[str, bytes] = {}
    whiteouts: set[str] = set()
    total = 0
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                if member.isdir():
                    continue
                if not member.isreg():
                    raise KilnError(f"layer entry {member.name!r} is not a file or directory")
                total += member.size
                if total > _UNPACKED_MAX:
                    raise KilnError(f"layer inflates past {_UNPACKED_MAX} bytes")
                parent, name = posixpath.split(member.name)
                if name.startswith(WHITEOUT_PREFIX):
                    whiteouts.add(posixpath.join(parent, name[len(WHITEOUT_PREFIX):]))
                else:
                    handle = tar.extractfile(member)
                    files[member.name] = handle.read() if handle else b""
    except (tarfile.TarError, OSError, EOFError) as err:
        raise KilnError(f"layer is not a readable tar: {err}") from None
    if not all(isinstance(r, str) for r in removals) or set(removals) != whiteouts:
        raise KilnError("layer whiteouts are not the removals its record lists")
    return LayerContents(files, tuple(removals), created_by)
