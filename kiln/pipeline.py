"""A build from start to end: check every output, prepare, bake, publish (the pipeline).

Public API:
    BuildResult      digests, tags, where each output went, bytes pulled/pushed, timings (``.to_json()``)
    run_build(inputs, publishers, registry_config=None, allow_unlocked=False, cache=None,
              reporter=SILENT, leave_out_unusable_kernels=False, sign_key=None,
              cache_from=(), cache_to=(), cache_key=None, platforms=None, warm=None) -> BuildResult

Every destination is checked before any work (``check_outputs``: never an input the build
reads, ``kiln.publish.destinations``; a push destination must answer and take a push); the deadline runs from the start; a pin with
no verdicts in the record is built with a warning (its verdicts land in the audit file); the pull,
the patching and the bake happen once; then every publisher writes the one ``BuiltImage``
(``kiln.publish.publish``: staged, committed together, the push last).

Registry build caches (``kiln.image.regcache``): ``cache_from`` is tried before the pull (a
verified patched entry replaces the patching, a kernel entry the compiling, both the pull);
after the outputs are committed, the build's entries are written to every ``cache_to`` (a failure there is a warning:
the image is already out), signed with ``sign_key`` when given; ``cache_key`` (a public key)
accepts only entries whose signature it verifies.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kiln.attest.dsse import SigningKey, envelope, open_envelope, verify_envelope
from kiln.attest.referrers import attestations
from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.image.image import BuiltIndex, bake
from kiln.image.inputs import BuildInputs
from kiln.image.layers import AUDIT_PATH
from kiln.image.prepare import prepare_build
from kiln.image.regcache import (
    RECORD_MEDIA_TYPE,
    SIGNED_RECORD_MEDIA_TYPE,
    entry_record,
    write_entry,
)
from kiln.image.warmcache import cached_warm
from kiln.image.wheelcache import write_wheel_entry
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.layer import write_layer
from kiln.oci.limits import Budget
from kiln.oci.reference import ImageReference
from kiln.oci.registry import RegistryClient
from kiln.patch.record import load_record
from kiln.pausepoint import pause_point
from kiln.publish import Publisher, check_outputs, publish
from kiln.publish.destinations import command_inputs
from kiln.publish.registry import RegistryPublisher
from kiln.publish.values import ValuesPublisher
from kiln.report import SILENT, Reporter
from kiln.warm.bake import with_warm


@dataclass
class BuildResult:
    image: str
    pin: str
    sm: int
    tag: str
    repository: str  # the name the image carries, e.g. ghcr.io/you/vllm-qwen3.6-27b-tq
    base: str  # the pin's reference
    base_digest: str  # what it resolved to (the digest a pin locks)
    base_manifest_digest: str  # the linux/amd64 manifest built on
    manifest_digest: str  # what the tag names: the image, or the index of the tag's platforms
    config_digest: str
    attestations: dict[str, str]  # artifact type -> the artifact manifest's digest (SBOM, provenance)
    signed: bool
    layer_digest: str  # the patched-source layer
    layer_diff_id: str
    layer_size: int
    media_type: str
    patches: list[dict]
    files_changed: int
    outputs: dict[str, str] = field(default_factory=dict)  # publisher kind -> where it went
    bytes_pulled: int = 0
    bytes_decompressed: int = 0  # base layer bytes inflated to read vLLM (bounded: kiln.oci.limits)
    bytes_pushed: int = 0
    blobs_uploaded: int = 0
    blobs_mounted: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    helm_values: dict = field(default_factory=dict)  # what --values writes (kiln.publish.values)
    triton: dict = field(default_factory=dict)  # the Triton kernel cache layer's summary, if any
    cache: dict = field(default_factory=dict)  # the registry build cache: key, hit (entry read), written
    platforms: dict = field(default_factory=dict)  # platform -> its manifest, base manifest, layer, kernels
    warm: dict = field(default_factory=dict)  # the warm layer's summary (kiln.warm), if --warm
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def run_build(inputs: BuildInputs, publishers: list[Publisher], repository: str,
              registry_config: RegistryConfig | None = None, allow_unlocked: bool = False,
              cache: Path | None = None, reporter: Reporter = SILENT,
              leave_out_unusable_kernels: bool = False, sign_key: SigningKey | None = None,
              cache_from: tuple[ImageReference, ...] | list = (),
              cache_to: tuple[ImageReference, ...] | list = (), cache_key=None,
              platforms: tuple[str, ...] | list | None = None, warm: Path | None = None,
              warm_from_cache: bool = False) -> BuildResult:
    """Build ``inputs`` and hand the image to every publisher; ``repository`` names it in the result.

    ``platforms`` (default: ``inputs.platform`` alone): the tag's platforms, each prepared and baked
    on its own manifest of the base; more than one makes the tag an OCI image index of them
    (``BuiltIndex``), published only once every platform is baked. Every platform's image gets
    its SBOM and provenance (signed with ``sign_key`` when given), which the registry and layout
    publishers attach as referrers of its manifest."""
    if (warm is not None or warm_from_cache) and len(platforms or (inputs.platform,)) > 1:
        option = f"--warm {warm}" if warm is not None else "--warm-from-cache"
        raise KilnError(f"{option}: a warm cache is made on one platform's hardware, and this tag has "
                        f"{len(platforms)} ({', '.join(platforms)}): build one (--platform OS/ARCH)")
    config = registry_config or RegistryConfig.load()
    budget = Budget(config.limits)  # the deadline runs from here: it bounds the whole command
    check_outputs(publishers, command_inputs(inputs.files, config.path, cache), budget)
    cache = cache or cache_root()
    record = inputs.files.record
    if inputs.pin.name not in load_record(record):
        # Nothing reviewed to compare with (a nightly pinned by hand): the build still decides
        # and fails closed on every verdict, and the audit file records them all.
        reporter.warn(f"pin {inputs.pin.name} has no recorded verdicts in {record}; this build's verdicts "
                      f"are in its {AUDIT_PATH} (review them: `verify --pin {inputs.pin.name} --accept`)")
    work_root = cache / "build"
    work_root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(dir=work_root, prefix=".tmp-"))
    shared: dict = {}  # source key -> (platform, its patch run): a tag's platforms of one source patch once
    try:
        images = [_bake_platform(replace(inputs, platform=platform), config, allow_unlocked, cache, reporter, budget,
                                 leave_out_unusable_kernels, cache_from, cache_key, sign_key, cache_to,
                                 workdir / platform.replace("/", "-"), warm, warm_from_cache, shared)
                  for platform in (platforms or (inputs.platform,))]
        image = images[0] if len(images) == 1 else BuiltIndex(images)
        clock = images[0].prepared.clock
        written = publish(image, publishers, budget)
        push = next((p for p in publishers if isinstance(p, RegistryPublisher)), None)
        clock.lap("publish", push.report.bytes_uploaded if push else 0)
        done: set = set()  # (kind, key) already written: the platforms' shared patched entry once
        written_to = [entry for part in images for entry in _write_cache(
            part.prepared, part, cache_to, config, budget, reporter,
            workdir / f"cache-{part.prepared.inputs.platform.replace('/', '-')}", sign_key, done)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    values = next((p.values(image) for p in publishers if isinstance(p, ValuesPublisher)), {})
    return _result(inputs, image, images, repository, written, values, push.report if push else None, budget,
                   written_to, sign_key is not None)


def _bake_platform(inputs: BuildInputs, config: RegistryConfig, allow_unlocked: bool, cache: Path,
                   reporter: Reporter, budget: Budget, leave_out_unusable_kernels: bool, cache_from, cache_key,
                   sign_key: SigningKey | None, cache_to, workdir: Path, warm: Path | None = None,
                   warm_from_cache: bool = False, shared: dict | None = None):
    """One platform's image: prepared on its own manifest of the base (``shared``: the patch runs
    of the platforms before it), baked, attested."""
    workdir.mkdir(parents=True)
    prepared = prepare_build(inputs, config, allow_unlocked, cache, reporter, budget,
                             leave_out_unusable_kernels=leave_out_unusable_kernels, cache_from=cache_from,
                             open_record=record_opener(cache_key),
                             keep_wheels=workdir / "wheels" if cache_to else None, shared=shared)
    if warm is not None:  # the warm bundle's key against this build's inputs, then its layer
        prepared = with_warm(prepared, warm)
    elif warm_from_cache:  # the registry build cache's entry of this build's warm key, if one verifies
        prepared = cached_warm(prepared, cache_from, config, budget, cache, reporter, record_opener(cache_key))
    budget.check_deadline("patch")  # and between the steps after it
    image = bake(prepared, workdir, reporter)
    image.attestations = attestations(image, sign_key)
    prepared.clock.lap("bake", sum(layer.size for layer in image.layers))  # kiln's layers, compressed
    pause_point("bake")
    budget.check_deadline("bake")
    return image


def _result(inputs: BuildInputs, image, images: list, repository: str, written: dict, values: dict, report,
            budget: Budget, written_to: list[str], signed: bool) -> BuildResult:
    """The build's summary: the first platform's image and base (as a one-platform build's), the
    tag's digest (the index's when there are several) and each platform's."""
    first = images[0]
    prepared, layer = first.prepared, first.layers[0]
    timings: dict[str, float] = {}
    for part in images:  # each platform's steps; the first clock runs from the start to the end
        for step, seconds in part.prepared.clock.timings.items():
            timings[step] = round(timings.get(step, 0) + seconds, 3)
    timings["total"] = prepared.clock.total()["total"]
    return BuildResult(
        image=inputs.definition.name, pin=inputs.pin.name, sm=inputs.sm, tag=inputs.tag, repository=repository,
        base=str(prepared.base_ref), base_digest=prepared.base_digest,
        base_manifest_digest=prepared.base_manifest_digest, manifest_digest=image.manifest.digest,
        config_digest=first.config_digest,
        attestations={a.artifact_type: a.manifest.digest for a in first.attestations},
        signed=signed,
        layer_digest=layer.digest, layer_diff_id=layer.diff_id,
        layer_size=layer.size, media_type=image.manifest.media_type,
        patches=[o.to_json() for o in prepared.outcomes.values()], files_changed=prepared.files_changed,
        outputs=written, helm_values=values, triton=prepared.triton,
        bytes_pulled=sum(part.prepared.stats.bytes_down for part in images),
        bytes_decompressed=budget.bytes_inflated,
        bytes_pushed=report.bytes_uploaded if report else 0,
        blobs_uploaded=len(report.uploaded) if report else 0, blobs_mounted=len(report.mounted) if report else 0,
        timings=timings, warm=prepared.warm,
        cache={"hit": [use.hit for part in images for use in part.prepared.cache if use.hit]
               + [use["hit"] for part in images for use in part.prepared.wheels.uses if use["hit"]] or None,
               "entries": [use.to_json() for part in images for use in part.prepared.cache]
               + [use for part in images for use in part.prepared.wheels.uses], "written": written_to},
        platforms={part.prepared.inputs.platform: _platform_summary(part) for part in images},
    )


def _platform_summary(image) -> dict:
    prepared = image.prepared
    return {"manifest_digest": image.manifest.digest, "base_manifest_digest": prepared.base_manifest_digest,
            "layer_digest": image.layers[0].digest, "triton": prepared.triton,
            "attestations": {a.artifact_type: a.manifest.digest for a in image.attestations}}


def record_opener(public_key=None):
    """How a cache entry's record is opened: with ``public_key``, only a record in a DSSE envelope
    one of whose signatures it verifies; without, any (its digest still checked)."""

    def open_record(data: bytes, media_type: str, where: str) -> bytes:
        if media_type == RECORD_MEDIA_TYPE and public_key is None:
            return data
        if media_type != SIGNED_RECORD_MEDIA_TYPE:
            raise KilnError("it is not signed; --cache-key takes signed entries only")
        payload_type, payload, signatures = open_envelope(data, where)
        if payload_type != RECORD_MEDIA_TYPE:
            raise KilnError(f"{where}: the envelope holds {payload_type}, not a kiln cache record")
        if public_key is None:
            return payload
        if not signatures:
            raise KilnError("it is not signed; --cache-key takes signed entries only")
        return verify_envelope(data, public_key, where)

    open_record.verifies = public_key is not None  # what it opens, its key signed (``CachedEntry.signed``)
    return open_record


def _write_cache(prepared, image, cache_to, config: RegistryConfig, budget: Budget, reporter: Reporter,
                 workdir: Path, sign_key: SigningKey | None = None, done: set | None = None) -> list[str]:
    """The build's entries (``prepared.cache``; a patched one also under its source key) into every
    ``cache_to``, but those in ``done`` (added to it); what was written."""
    if not cache_to:
        return []
    done = set() if done is None else done
    entries = []
    for use in prepared.cache:  # an image layer's blob is that layer's
        keys = [(use.key, use.inputs)] if use.writable else []
        keys += [use.source] if use.source is not None else []
        if not (keys := [(key, inputs) for key, inputs in keys if (use.kind, key) not in done]):
            continue
        done.update((use.kind, key) for key, _ in keys)
        baked = {id(contents): layer for contents, layer in zip(prepared.layers, image.layers, strict=True)}
        layers = [baked.get(id(contents)) or write_layer(contents, workdir / use.kind) for contents in use.contents]
        record = entry_record(use, layers)
        entries += [(use, key, {**record, "key": key, "inputs": inputs}, layers) for key, inputs in keys]
    seal = (lambda data: envelope(data, sign_key, RECORD_MEDIA_TYPE)) if sign_key else None
    written = []
    for location in cache_to:
        client = RegistryClient(config.endpoint(location.registry, push=True), budget=budget)
        for use, key, record, layers in entries:
            try:
                digest = write_entry(client, location.repository, use.kind, key, record, layers, seal=seal)
            except KilnError as err:
                reporter.warn(f"build cache {location.name}: {use.kind} entry not written: {err}")
                continue
            written.append(f"{location.name}@{digest}")
        for name, sha256, path in prepared.wheels.kept:  # the Triton wheel this build fetched from the index
            try:
                digest = write_wheel_entry(client, location.repository, name, sha256, path)
            except KilnError as err:
                reporter.warn(f"build cache {location.name}: toolchain entry not written: {err}")
                continue
            written.append(f"{location.name}@{digest}")
    return written
