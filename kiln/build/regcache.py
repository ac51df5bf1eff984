"""A build cache in a registry, shared across machines: ``build --cache-to/--cache-from REGISTRY/REPO``.

Public API:
    CACHE_ARTIFACT_TYPE, RECORD_MEDIA_TYPE, SIGNED_RECORD_MEDIA_TYPE
    parse_cache_location(text, where) -> ImageReference     ``REGISTRY/REPO``, no tag or digest
    cache_key(inputs, base_digest, leave_out_unusable_kernels) -> (hex key, the inputs it hashes)
    entry_tag(key) -> str                                    ``kiln-cache-v1-<key>``
    CachedBuild(record, layers)                              a verified entry: kiln's layers as ``LayerContents``
    read_entry(client, repository, key, key_inputs, workdir, reporter=SILENT, open_record=plain_record)
        -> CachedBuild | None
    plain_record(data, media_type, where) -> bytes   the record of an unsigned entry (a signed one: a miss)
    entry_record(key, key_inputs, prepared, layers) -> dict
    write_entry(client, repository, key, record, layers, seal=None) -> str (the entry's manifest digest)

A build is a pure function of its inputs (reproducible by construction), so what it computes
from the base's vLLM layers (the patched-source layer, the Triton kernel layer and the facts
the labels, audit file, SBOM and provenance need) can be cached by a key of those inputs.
The key is known before any base layer is read: the base's digest (it names every layer: a
superset key), the definition file and its baked files, the selected patch modules' sha256,
the pin, SM and tag, kiln's own code (every module and schema) and Python's version (the
Triton toolchain wheel is per CPython). An entry is an OCI artifact manifest
(``artifactType`` ``application/vnd.kiln.cache.v1``) tagged by its key in the cache
repository: its config is the record (the key and the inputs it hashes, the verdicts, the
layers' digests, removals and history, env, the Triton summary), its layers are kiln's
layer blobs. Written with a signing key (``build --sign-key``), the config is instead a DSSE
envelope of the record (``seal``, ``kiln.attest.dsse``), and a reader given the public key
(``--cache-key``) takes only entries whose signature verifies: the record names every layer
by digest, so the signature covers the whole entry.

Reading verifies everything: the manifest's and every blob's digest and size; the record's
key and inputs equal the ones this build computed (an entry copied under another key is
refused); the layers re-derive: their contents written again by ``kiln.oci.layer`` give the
recorded digest and diff_id, so what the build bakes from them is byte for byte the entry.
Anything wrong is a miss with a warning, never an image. Concurrent writers of one key are
safe: each uploads every blob its manifest names (content-addressed, so they share them)
before it PUTs the manifest, and a tag's PUT replaces it whole; the last writer's entry wins,
and any writer's entry gives the same image (records differ only in what the build reports,
such as the kernels' compile seconds, or an ECDSA signature's nonce).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import kiln
from kiln import __version__
from kiln.build.inputs import BuildInputs
from kiln.errors import KilnError
from kiln.oci.digest import sha256_digest
from kiln.oci.layer import WHITEOUT_PREFIX, Layer, LayerContents, write_layer
from kiln.oci.manifest import Descriptor, Manifest
from kiln.oci.mediatypes import OCI_LAYER_GZIP, OCI_MANIFEST
from kiln.oci.reference import ImageReference, parse_reference
from kiln.oci.registry import RegistryClient
from kiln.patch.model import Outcome, Verdict
from kiln.report import SILENT, Reporter

CACHE_ARTIFACT_TYPE = "application/vnd.kiln.cache.v1"
RECORD_MEDIA_TYPE = "application/vnd.kiln.cache.record.v1+json"
SIGNED_RECORD_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"  # its payload: a record
KEY_ANNOTATION = "dev.kiln.cache.key"
_RECORD_MAX = 16 << 20  # a record is verdicts and digests: kilobytes
_UNPACKED_MAX = 4 << 30  # what one cached layer may inflate to before it is refused


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


@cache
def _kiln_code() -> str:
    """sha256 over kiln's own modules and schemas: any change to kiln is a new key."""
    root = Path(kiln.__file__).parent
    h = hashlib.sha256(f"kiln {__version__}\n".encode())
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and p.is_file()):
        h.update(f"{path.relative_to(root).as_posix()}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def cache_key(inputs: BuildInputs, base_digest: str, leave_out_unusable_kernels: bool = False) -> tuple[str, dict]:
    """The key of a build, from what it is asked for and the base's digest only (no layer read)."""
    definition, pin, catalogue = inputs.definition, inputs.pin, inputs.catalogue
    selected = catalogue.closure(list(definition.patches))
    key_inputs = {
        "format": CACHE_ARTIFACT_TYPE,
        "kiln": {"version": __version__, "code": _kiln_code()},
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "base": base_digest,
        "definition": {"name": definition.name, "images_dir": inputs.files.images.name,
                       "sha256": hashlib.sha256(definition.path.read_bytes()).hexdigest()},
        "baked": {f.path: f.sha256 for f in definition.files},
        "patches": {pid: catalogue.digests[pid] for pid in sorted(selected)},
        "pin": {"name": pin.name, "image": pin.image, "vllm": str(pin.vllm), "cuda": pin.cuda,
                "digest": pin.digest or None},
        "sm": inputs.sm,
        "tag": inputs.tag,
        "leave_out_unusable_kernels": leave_out_unusable_kernels,
    }
    return hashlib.sha256(_canonical(key_inputs)).hexdigest(), key_inputs


def entry_tag(key: str) -> str:
    return f"kiln-cache-v1-{key}"


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass
class CachedBuild:
    """A verified entry: its record and kiln's layers, ready to bake (the same bytes as the entry's)."""

    record: dict
    layers: list[LayerContents]
    where: str  # registry/repository:tag it was read from

    @property
    def outcomes(self) -> dict[str, Outcome]:
        out = {}
        for data in self.record["outcomes"]:
            files = {rel: (v["before"], v["after"]) for rel, v in data.get("files", {}).items()} or None
            out[data["patch"]] = Outcome(data["patch"], Verdict(data["verdict"]), data.get("detail", ""), files)
        return out


def entry_record(key: str, key_inputs: dict, prepared, layers: list[Layer]) -> dict:
    """What a hit needs to give the same ``PreparedBuild`` as the build that wrote it."""
    return {
        "key": key,
        "inputs": key_inputs,
        "base_manifest_digest": prepared.base_manifest_digest,
        "vllm_version": prepared.vllm_version,
        "site_dir": prepared.site_dir,
        "outcomes": [o.to_json() for o in prepared.outcomes.values()],
        "applied": list(prepared.applied),
        "files_changed": prepared.files_changed,
        "env": dict(prepared.env),
        "triton": prepared.triton,
        "layers": [{"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size,
                    "created_by": contents.created_by, "removals": list(contents.removals)}
                   for layer, contents in zip(layers, prepared.layers, strict=True)],
    }


def plain_record(data: bytes, media_type: str, where: str) -> bytes:
    """The record of an unsigned entry; a signed one needs an opener that checks it (a miss here)."""
    if media_type != RECORD_MEDIA_TYPE:
        raise KilnError(f"its config is {media_type}, not an unsigned kiln cache record")
    return data


def write_entry(client: RegistryClient, repository: str, key: str, record: dict, layers: list[Layer],
                seal: Callable[[bytes], bytes] | None = None) -> str:
    """Upload the layers and the record (unless present), then PUT the entry's manifest under its tag.

    ``seal``: the record's bytes -> a DSSE envelope of them (signed)."""
    record_bytes = _canonical(record)
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
        "artifactType": CACHE_ARTIFACT_TYPE,
        "config": {"mediaType": media_type, "digest": record_digest, "size": len(record_bytes)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": layer.digest, "size": layer.size} for layer in layers],
        "annotations": {KEY_ANNOTATION: key},
    }
    return client.put_manifest(repository, entry_tag(key), _canonical(manifest), OCI_MANIFEST)


def read_entry(client: RegistryClient, repository: str, key: str, key_inputs: dict, workdir: Path,
               reporter: Reporter = SILENT, open_record: Callable[[bytes, str, str], bytes] = plain_record,
               ) -> CachedBuild | None:
    """The entry of ``key``, verified; None (a miss) when there is none or it is not right (with a warning)."""
    tag = entry_tag(key)
    where = f"{client.endpoint.registry}/{repository}:{tag}"
    try:
        manifest = client.find_manifest(repository, tag)
        if manifest is None:
            reporter.note(f"build cache {client.endpoint.registry}/{repository}: no entry for this build")
            return None
        return _verified(client, repository, manifest, key, key_inputs, workdir, where, open_record)
    except KilnError as err:
        reporter.warn(f"build cache entry {where} refused, building without it: {err}")
        return None


def _verified(client: RegistryClient, repository: str, manifest: Manifest, key: str, key_inputs: dict,
              workdir: Path, where: str, open_record: Callable[[bytes, str, str], bytes]) -> CachedBuild:
    body = manifest.json
    if body.get("artifactType") != CACHE_ARTIFACT_TYPE:
        raise KilnError(f"not a kiln cache entry (artifactType {body.get('artifactType')!r})")
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
    if not isinstance(record, dict) or record.get("key") != key or record.get("inputs") != key_inputs:
        raise KilnError("its record is another build's (key or inputs differ from this build's)")
    descriptors = [Descriptor.from_json(d, f"{where} layer") for d in body.get("layers") or []]
    recorded = record.get("layers")
    if not isinstance(recorded, list) or [(d.digest, d.size) for d in descriptors] != \
            [(r.get("digest"), r.get("size")) for r in recorded if isinstance(r, dict)]:
        raise KilnError("its layers are not the ones its record lists")
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
    _check_fields(record)
    return CachedBuild(record, contents, where)


def _check_fields(record: dict) -> None:
    """Every field a hit uses, of the type it is used as: a record a build could not use is a miss."""
    kinds = {"outcomes": list, "applied": list, "env": dict, "triton": dict, "vllm_version": str,
             "site_dir": str, "base_manifest_digest": str, "files_changed": int}
    for name, kind in kinds.items():
        if not isinstance(record.get(name), kind):
            raise KilnError(f"its record's {name!r} is not a {kind.__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in record["env"].items()) or \
            not all(isinstance(pid, str) for pid in record["applied"]):
        raise KilnError("its record's env or applied patches are not strings")
    try:
        CachedBuild(record, [], "").outcomes  # noqa: B018 - each verdict parses
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise KilnError(f"its record's outcomes do not parse ({err!r})") from None


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
