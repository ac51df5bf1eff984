"""A build cache in a registry, shared across machines: ``build --cache-to/--cache-from REGISTRY/REPO``.

Public API:
    PATCHED, KERNELS                 the entry kinds; ARTIFACT_TYPES: kind -> artifactType
    RECORD_MEDIA_TYPE, SIGNED_RECORD_MEDIA_TYPE
    parse_cache_location(text, where) -> ImageReference     ``REGISTRY/REPO``, no tag or digest
    patched_key(inputs, base_digest) -> (hex key, the inputs it hashes)
    kernels_key(inputs, base_digest, patched, leave_out_unusable_kernels) -> (hex key, inputs)
    entry_tag(kind, key) -> str                              ``kiln-cache-<kind>-v1-<key>``
    CacheUse(kind, key, inputs, sm)  one entry a build looks up: hit or not, what it would write
    CachedEntry(record, layers, where)                       a verified entry: its layers as ``LayerContents``
    read_entry(client, repository, kind, key, key_inputs, workdir, reporter=SILENT, open_record=plain_record)
        -> CachedEntry | None
    plain_record(data, media_type, where) -> bytes   the record of an unsigned entry (a signed one: a miss)
    entry_record(use, layers) -> dict
    write_entry(client, repository, kind, key, record, layers, seal=None) -> str (the entry's manifest digest)

A build is a pure function of its inputs (reproducible by construction), so what it computes
from the base's layers can be cached by a key of the inputs each part depends on. There are
two kinds of entry (and the Triton wheel's, ``kiln.build.wheelcache``), so that builds
sharing part of their inputs share that part's entry:

* ``patched``: the patching's result: every verdict, the changed modules and the whiteouts of
  their stale bytecode (one layer), vLLM's version and site dir, each changed file's pristine
  sha256. Its key: the base's digest (it names every layer, the vLLM layers included: a
  superset key), the selection (the definition's list and every selected patch module's
  sha256), what the build target decides of each patch (out of range, gated: the only use the
  engine makes of the pin's vLLM, the SM and the model preset), kiln's own code and Python's
  ``major.minor``. No image name, tag, SM or baked file: the image's patched-source layer
  (with its baked files and audit file) is assembled from the entry by each build, so images
  on one base with one selection share it, whatever their SMs.
* ``kernels``: one SM's Triton kernel layer (or none, left out) and its summary and env. Its
  key: the base's digest (its Triton, hence the toolchain wheel, its Python and config Env),
  the kernel preset, the SM, the definition's serve env, ``--without-unusable-kernels``,
  kiln's code and Python's version, and the kernel sources: "pristine" when no selected patch
  touches a file the kernels are compiled from (the base's digest names them), else the
  patched entry's key. A change of patch selection that touches no kernel source keeps it.

The keys are known before any base layer is read. An entry is an OCI artifact manifest
(``artifactType`` per kind) tagged by its kind and key in the cache repository: its config is
the record (the kind, the key and the inputs it hashes, the kind's fields, its layers'
digests, removals and history), its layers are the blobs. Written with a signing key
(``build --sign-key``), the config is instead a DSSE envelope of the record (``seal``,
``kiln.attest.dsse``), and a reader given the public key (``--cache-key``) takes only entries
whose signature verifies: the record names every layer by digest, so the signature covers
the whole entry.

Reading verifies everything: the manifest's and every blob's digest and size; the record's
kind, key and inputs equal the ones this build computed (an entry copied under another key is
refused); the layers re-derive: their contents written again by ``kiln.oci.layer`` give the
recorded digest and diff_id, so what the build bakes from them is byte for byte the entry.
Anything wrong is a miss with a warning, never an image; a miss of one entry leaves the other
usable. Concurrent writers of one key are safe: each uploads every blob its manifest names
(content-addressed, so they share them) before it PUTs the manifest, and a tag's PUT replaces
it whole; the last writer's entry wins, and any writer's entry gives the same image (records
differ only in what the build reports, such as the kernels' compile seconds, or an ECDSA
signature's nonce).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
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
from kiln.triton.aot import reads_source

PATCHED, KERNELS = "patched", "kernels"
ARTIFACT_TYPES = {PATCHED: "application/vnd.kiln.cache.patched.v1",
                  KERNELS: "application/vnd.kiln.cache.kernels.v1"}
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


def _keyed(kind: str, key_inputs: dict) -> tuple[str, dict]:
    key_inputs = json.loads(_canonical({"kind": kind, "format": ARTIFACT_TYPES[kind],
                                        "kiln": {"version": __version__, "code": _kiln_code()},
                                        "python": f"{sys.version_info[0]}.{sys.version_info[1]}", **key_inputs}))
    return hashlib.sha256(_canonical(key_inputs)).hexdigest(), key_inputs  # as read back: lists, not tuples


def patched_key(inputs: BuildInputs, base_digest: str) -> tuple[str, dict]:
    """The patched entry's key: the base, the selection and what the target decides of each patch."""
    definition, catalogue, target = inputs.definition, inputs.catalogue, inputs.target()
    patches = []
    for pid in catalogue.closure(list(definition.patches)):
        patch = catalogue.get(pid)
        patches.append({"id": pid, "sha256": catalogue.digests[pid],
                        "out_of_range": patch.outside_range(target.vllm_version) or None,
                        "gated": patch.gates.blocks(target) or None})
    return _keyed(PATCHED, {"base": base_digest, "vllm": str(inputs.pin.vllm),
                            "selection": list(definition.patches), "patches": patches})


def kernels_key(inputs: BuildInputs, base_digest: str, patched: str,
                leave_out_unusable_kernels: bool = False) -> tuple[str, dict]:
    """One SM's kernel entry's key (``patched``: the patched entry's key, used only when a selected
    patch touches a file the kernels are compiled from)."""
    definition, catalogue = inputs.definition, inputs.catalogue
    kernels = definition.model.kernels
    touched = any(reads_source(kernels, rel) for pid in catalogue.closure(list(definition.patches))
                  for rel in catalogue.get(pid).targets)
    return _keyed(KERNELS, {"base": base_digest, "sm": inputs.sm, "preset": kernels.to_json(),
                            "serve_env": dict(definition.serve_env),
                            "leave_out_unusable_kernels": leave_out_unusable_kernels,
                            "sources": patched if touched else "pristine"})


def entry_tag(kind: str, key: str) -> str:
    return f"kiln-cache-{kind}-v1-{key}"


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass
class CacheUse:
    """One entry a build looks up (``hit``: where it was read from) and would write: its record's
    own fields and its layers' contents, set by the build."""

    kind: str
    key: str
    inputs: dict
    sm: int | None = None
    hit: str | None = None  # registry/repository:tag of the entry used
    location: ImageReference | None = None  # the cache repository it was read from
    fields: dict = field(default_factory=dict)
    contents: list[LayerContents] = field(default_factory=list)

    def to_json(self) -> dict:
        out = {"kind": self.kind, "key": self.key, "tag": entry_tag(self.kind, self.key), "hit": self.hit}
        if self.sm is not None:
            out["sm"] = self.sm
        return out


@dataclass
class CachedEntry:
    """A verified entry: its record and layers, ready to bake (the same bytes as the entry's)."""

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
        "artifactType": ARTIFACT_TYPES[kind],
        "config": {"mediaType": media_type, "digest": record_digest, "size": len(record_bytes)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": layer.digest, "size": layer.size} for layer in layers],
        "annotations": {KEY_ANNOTATION: key},
    }
    return client.put_manifest(repository, entry_tag(kind, key), _canonical(manifest), OCI_MANIFEST)


def read_entry(client: RegistryClient, repository: str, kind: str, key: str, key_inputs: dict, workdir: Path,
               reporter: Reporter = SILENT, open_record: Callable[[bytes, str, str], bytes] = plain_record,
               ) -> CachedEntry | None:
    """The ``kind`` entry of ``key``, verified; None (a miss) when there is none or it is not right (with a warning)."""
    tag = entry_tag(kind, key)
    where = f"{client.endpoint.registry}/{repository}:{tag}"
    try:
        manifest = client.find_manifest(repository, tag)
        if manifest is None:
            reporter.note(f"build cache {client.endpoint.registry}/{repository}: no {kind} entry for this build")
            return None
        return _verified(client, repository, manifest, kind, key, key_inputs, workdir, where, open_record)
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
    if len(descriptors) > 1 or (kind == PATCHED and not descriptors):
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


_FIELDS = {PATCHED: {"outcomes": list, "applied": list, "vllm_version": str, "site_dir": str,
                     "base_manifest_digest": str, "before": dict},
           KERNELS: {"env": dict, "triton": dict}}


def _check_fields(kind: str, entry: CachedEntry) -> None:
    """Every field a hit uses, of the type it is used as: a record a build could not use is a miss."""
    record = entry.record
    for name, expected in _FIELDS[kind].items():
        if not isinstance(record.get(name), expected):
            raise KilnError(f"its record's {name!r} is not a {expected.__name__}")
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
    if not all(path.startswith(prefix) for path in entry.layers[0].files):
        raise KilnError(f"its layer holds files outside {prefix}")
    if not set(record["before"]) <= set(changed) or \
            not all(isinstance(v, str) for v in record["before"].values()):
        raise KilnError("its record's 'before' is not a sha256 per changed file")


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
