"""``build.py build``: pull the pinned base, bake the patched layer, write or push the image.

Public API:
    Outputs(push=False, oci=None, docker_archive=None, repository=None, values=None)
    BuildResult     digests, tags, references, bytes pulled/pushed, timings (``.to_json()``)
    prepare_build(definition, pin, sm, catalogue, registry_config=None, allow_unlocked=False,
                  cache=None) -> PreparedBuild      resolve, pull, patch; kiln's layers as LayerContents
    build_image(definition, pin, sm, catalogue, outputs, registry_config=None,
                allow_unlocked=False, cache=None) -> BuildResult     prepare_build, bake, publish
    add_build_parser(subparsers)    registers the ``build`` command
    cmd_build(args) -> int

End to end: resolve the pin's base reference to a digest (one manifest HEAD) and check it
against the pin's lock; read the pristine ``vllm/`` from only the top layers that hold it
(``ImageSource``); run the image's patch selection on it; bake the changed files, bytecode
whiteouts and the audit file into one deterministic layer; derive the new config and manifest
(pure steps, canonical JSON); then write the outputs, each staged and renamed into place, the
registry push last and its manifest only after every blob is confirmed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln import __version__, ui
from kiln.bake import (
    LayerContents,
    audit_record,
    kiln_revision,
    kiln_source_url,
    patched_contents,
    write_layer,
)
from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.helm import helm_values, stage_values
from kiln.images import ImageDefinition, add_target_options, image_pins, load_image
from kiln.oci.blobcache import BlobCache
from kiln.oci.endpoints import RegistryConfig, add_registry_options, config_from_options
from kiln.oci.image import RemoteImage
from kiln.oci.mutate import (
    ImageModel,
    append_layer,
    to_oci,
    with_annotations,
    with_env,
    with_labels,
)
from kiln.oci.pull import ImageSource, ImageVllm
from kiln.oci.reference import ImageReference, parse_reference
from kiln.oci.registry import RegistryClient, TransferStats
from kiln.oci.sinks import BlobStore, Staged, push_image, stage_docker_archive, stage_oci_layout
from kiln.patch.catalog import Catalogue, load_catalogue
from kiln.patch.engine import Session, run_selection
from kiln.patch.model import Outcome, Verdict
from kiln.pausepoint import pause_point
from kiln.pins import Pin, get_pin, load_pins
from kiln.triton.image import image_env, triton_cache_layer

_BROKEN = (Verdict.CONFLICT, Verdict.DRIFTED, Verdict.TARGET_GONE)


@dataclass(frozen=True)
class Outputs:
    push: bool = False
    oci: Path | None = None
    docker_archive: Path | None = None
    repository: str | None = None  # overrides the image definition's destination repository
    values: Path | None = None  # the image's Helm values file (kiln.helm)


@dataclass
class BuildResult:
    image: str
    pin: str
    sm: int
    tag: str
    repository: str  # destination, e.g. docker.io/kiln/vllm-qwen3.6-27b-tq
    base: str  # the pin's reference
    base_digest: str  # what it resolved to (the digest a pin locks)
    base_manifest_digest: str  # the linux/amd64 manifest built on
    manifest_digest: str
    config_digest: str
    layer_digest: str
    layer_diff_id: str
    layer_size: int
    media_type: str
    patches: list[dict]
    files_changed: int
    outputs: dict[str, str] = field(default_factory=dict)  # "push" / "oci" / "docker-archive" -> where
    bytes_pulled: int = 0
    bytes_pushed: int = 0
    blobs_uploaded: int = 0
    blobs_mounted: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    helm_values: dict = field(default_factory=dict)  # what --values writes (kiln.helm)
    triton: dict = field(default_factory=dict)  # the Triton kernel cache layer (kiln.triton.image), if any

    def to_json(self) -> dict:
        return asdict(self)


def cuda_flavour(pin: Pin, base_config: dict) -> str:
    """The pin's CUDA flavour, else ``cuXYZ`` from the base config's ``CUDA_VERSION``."""
    if pin.cuda:
        return pin.cuda
    for entry in (base_config.get("config") or {}).get("Env") or []:
        key, _, value = entry.partition("=")
        if key == "CUDA_VERSION":
            parts = value.split(".")
            if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                return f"cu{parts[0]}{parts[1]}"
    raise KilnError(f"pin {pin.name}: no cuda flavour given and the base config has no CUDA_VERSION")


def _check_lock(pin: Pin, resolved: str, allow_unlocked: bool) -> None:
    if not pin.locked:
        if not allow_unlocked:
            raise KilnError(
                f"pin {pin.name} is not locked ({pin.image} now resolves to {resolved}); run "
                f"`build.py pin lock {pin.name}` to lock it, or pass --allow-unlocked"
            )
        ui.stderr.print(f"[yellow]warning:[/] pin {pin.name} is unlocked; building {pin.image}@{resolved}")
    elif pin.digest != resolved:
        if not allow_unlocked:
            raise KilnError(
                f"pin {pin.name} is locked to {pin.digest} but {pin.image} now resolves to {resolved}; "
                "review the new base and re-lock the pin, or pass --allow-unlocked"
            )
        ui.stderr.print(f"[yellow]warning:[/] pin {pin.name} lock differs; building {pin.image}@{resolved}")


class _Clock:
    """Seconds spent in each step, for ``--json`` and the benchmarks."""

    def __init__(self) -> None:
        self.started = self._mark = time.monotonic()
        self.timings: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.timings[name] = round(now - self._mark, 3)
        self._mark = now

    def total(self) -> dict[str, float]:
        self.timings["total"] = round(time.monotonic() - self.started, 3)
        return self.timings


@dataclass
class PreparedBuild:
    """Everything a build decides before anything is written: the resolved base and the
    contents of kiln's layers. ``build`` bakes it into an image; ``context`` writes it as a
    Dockerfile build context. Both sinks read the same value, so they cannot drift apart."""

    definition: ImageDefinition
    pin: Pin
    sm: int
    tag: str
    base_ref: ImageReference  # the pin's reference, as written
    base_digest: str  # what it resolved to (the digest a pin locks)
    found: ImageVllm
    base: RemoteImage
    base_model: ImageModel  # the base, as an OCI image model
    client: RegistryClient  # the base registry's client (reused for a same-host push)
    stats: TransferStats
    outcomes: dict[str, Outcome]
    applied: list[str]
    files_changed: int
    layers: list[LayerContents]  # kiln's layers over the base, bottom first
    labels: dict[str, str]  # config labels (and manifest annotations) of the image
    clock: _Clock
    env: dict[str, str] = field(default_factory=dict)  # config Env entries kiln sets (TRITON_CACHE_DIR)
    triton: dict = field(default_factory=dict)  # the kernel cache layer's summary (kiln.triton.image)

    @property
    def base_by_digest(self) -> str:
        """``registry/repository@sha256:…``: the base as a Dockerfile's ``FROM`` must name it."""
        return f"{self.base_ref.name}@{self.base_digest}"


def prepare_build(definition: ImageDefinition, pin: Pin, sm: int, catalogue: Catalogue,
                  registry_config: RegistryConfig | None = None, allow_unlocked: bool = False,
                  cache: Path | None = None) -> PreparedBuild:
    """Resolve and check the base, read its pristine vLLM, patch it, and decide kiln's layers."""
    clock = _Clock()
    if sm not in definition.sms:
        raise KilnError(f"{definition.path}: sm {sm} is not one of the image's sms {list(definition.sms)}")
    config = registry_config or RegistryConfig.load()
    cache = cache or cache_root()

    # 1. resolve the base and check the lock
    base_ref = parse_reference(pin.image)
    stats = TransferStats()
    source = ImageSource(base_ref, expected_version=pin.vllm, registry_config=config, cache=cache, stats=stats)
    resolved = base_ref.digest or source.client.resolve(base_ref.repository, base_ref.ref)
    _check_lock(pin, resolved, allow_unlocked)
    clock.lap("resolve")

    # 2. the pristine vLLM, from the top layers of the base only
    source.reference = base_ref.pinned(resolved)
    found = source.pull()
    base = RemoteImage(base_ref.pinned(resolved), source.client, BlobCache(cache / "blobs"),
                       manifest_cache=cache / "manifests")
    base_config = base.config()
    # One flavour for every sink (skopeo's layout reader ignores Docker v2 manifests).
    base_model = to_oci(ImageModel.from_base(base.manifest(), base.config_bytes()))
    clock.lap("pull")

    # 3. patch
    tree = found.tree
    result = run_selection(catalogue, Session(tree), definition.target(pin, sm), list(definition.patches))
    for outcome in result.outcomes.values():
        if outcome.verdict in _BROKEN:
            raise KilnError(
                f"patch {outcome.patch_id} is {outcome.verdict} on {pin.name} ({base_ref}): {outcome.detail}"
            )
    changed = result.changed_text()
    before = {rel: tree.read(rel) for rel in changed if tree.exists(rel)}
    applied = [pid for pid, o in result.outcomes.items() if o.verdict is Verdict.APPLIES]
    clock.lap("patch")
    pause_point("patch")

    # 4. what kiln's layers hold, and the image's labels
    tag = definition.tag_template.format(cuda=cuda_flavour(pin, base_config), sm=sm, pin=pin.name)
    pin_json = {"name": pin.name, "image": pin.image, "vllm": str(pin.vllm), "cuda": pin.cuda,
                "digest": pin.digest or None}
    audit = audit_record(image=definition.name, pin=pin_json, sm=sm, base_reference=str(base_ref),
                         base_digest=resolved, site_dir=found.site_dir, outcomes=result.outcomes,
                         before=before, changed=changed)
    layers = [patched_contents(
        changed, found.site_dir, found.vllm_files, audit,
        created_by=f"kiln bake {definition.name} {pin.name} sm{sm}: {','.join(applied) or 'no patch'}")]
    # Further layers kiln adds (e.g. a Triton cache) are appended to ``layers`` here, as
    # LayerContents: the image and the Dockerfile context both pick them up from this list.
    env: dict[str, str] = {}
    triton: dict = {}
    if definition.model.kernels:  # 4b. the ahead-of-time Triton kernel cache, one layer per SM
        kernel_layer = triton_cache_layer(definition, sm, found, changed, image_env(base_config), cache)
        layers.append(kernel_layer.contents)
        env, triton = kernel_layer.env, kernel_layer.summary
        clock.lap("triton")
    commit, _ = kiln_revision()
    labels = {
        "org.opencontainers.image.base.name": str(base_ref),
        "org.opencontainers.image.base.digest": resolved,
        "org.opencontainers.image.version": tag,
        "io.kiln.image": definition.name,
        "io.kiln.pin": pin.name,
        "io.kiln.sm": str(sm),
        "io.kiln.patches": ",".join(applied),
        "io.kiln.vllm": str(tree.vllm_version),
    }
    if commit:
        labels["org.opencontainers.image.revision"] = commit
    source_url = kiln_source_url()
    if source_url:
        labels["org.opencontainers.image.source"] = source_url
    return PreparedBuild(
        definition=definition, pin=pin, sm=sm, tag=tag, base_ref=base_ref, base_digest=resolved, found=found,
        base=base, base_model=base_model, client=source.client, stats=stats, outcomes=result.outcomes,
        applied=applied, files_changed=len(changed), layers=layers, labels=labels, clock=clock,
        env=env, triton=triton,
    )


def build_image(definition: ImageDefinition, pin: Pin, sm: int, catalogue: Catalogue, outputs: Outputs,
                registry_config: RegistryConfig | None = None, allow_unlocked: bool = False,
                cache: Path | None = None) -> BuildResult:
    config = registry_config or RegistryConfig.load()
    cache = cache or cache_root()
    destination = parse_reference(outputs.repository or definition.repository)
    if destination.digest:
        raise KilnError(f"destination {destination}: a repository, not a digest, is expected")
    prepared = prepare_build(definition, pin, sm, catalogue, config, allow_unlocked, cache)
    base_ref, base, tag, clock = prepared.base_ref, prepared.base, prepared.tag, prepared.clock

    work_root = cache / "build"
    work_root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(dir=work_root, prefix=".tmp-"))
    try:
        # 5. bake: each of kiln's layers as a deterministic tar, then the config and manifest
        model = prepared.base_model
        baked = []
        for contents in prepared.layers:
            written_layer = write_layer(contents, workdir)
            model = append_layer(model, written_layer.digest, written_layer.diff_id, written_layer.size,
                                 created_by=contents.created_by, comment=f"kiln {__version__}")
            baked.append(written_layer)
        layer = baked[0]  # the patched-source layer
        model = with_annotations(with_labels(model, prepared.labels), prepared.labels)
        if prepared.env:
            model = with_env(model, prepared.env)
        manifest = model.manifest()
        values = helm_values(definition, pin, sm, destination.name, tag, manifest.digest)
        clock.lap("bake")
        pause_point("bake")

        # 6. publish: stage local outputs, push, then rename the local outputs into place
        new_blobs: dict[str, Path | bytes] = {b.digest: b.path for b in baked}
        new_blobs[model.config_descriptor().digest] = model.config_bytes()
        blobs = BlobStore(base, new_blobs, workdir)
        written: dict[str, str] = {}
        bytes_pushed = uploaded = mounted = 0
        staged: list[tuple[str, Staged]] = []
        try:
            if outputs.oci:
                staged.append(("oci", stage_oci_layout(model, blobs, outputs.oci, tag)))
            if outputs.values:
                staged.append(("values", stage_values(values, outputs.values)))
            if outputs.docker_archive:
                staged.append(("docker-archive", stage_docker_archive(
                    model, blobs, outputs.docker_archive, [f"{destination.name}:{tag}"])))
            if outputs.push:
                same_host = config.endpoint(destination.registry).host == config.endpoint(base_ref.registry).host
                client = prepared.client if same_host else RegistryClient.for_registry(
                    destination.registry, config, stats=TransferStats())
                report = push_image(model, blobs, client, destination.repository, [tag],
                                    mount_from=base_ref.repository if same_host else None)
                written["push"] = f"{destination.name}:{tag}@{report.digest}"
                bytes_pushed, uploaded, mounted = report.bytes_uploaded, len(report.uploaded), len(report.mounted)
            # local outputs become visible only once everything (the push included) succeeded
            for kind, item in staged:
                path = item.commit()
                written[kind] = {"oci": f"oci:{path}:{tag}", "docker-archive": f"docker-archive:{path}"}.get(kind, str(path))
        except BaseException:
            for _, item in staged:
                item.discard()
            raise
        clock.lap("publish")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return BuildResult(
        image=definition.name, pin=pin.name, sm=sm, tag=tag, repository=destination.name,
        base=str(base_ref), base_digest=prepared.base_digest, base_manifest_digest=prepared.found.manifest_digest,
        manifest_digest=manifest.digest, config_digest=model.config_descriptor().digest,
        layer_digest=layer.digest, layer_diff_id=layer.diff_id, layer_size=layer.size,
        media_type=manifest.media_type,
        patches=[o.to_json() for o in prepared.outcomes.values()], files_changed=prepared.files_changed,
        outputs=written, helm_values=values, triton=prepared.triton, bytes_pulled=prepared.stats.bytes_down,
        bytes_pushed=bytes_pushed, blobs_uploaded=uploaded, blobs_mounted=mounted, timings=clock.total(),
    )


# -- command line ----------------------------------------------------------------------------


def load_build_inputs(args) -> tuple[ImageDefinition, Pin, Catalogue]:
    """The image definition, pin and catalogue named by ``--image``/``--pin`` (checked to match)."""
    catalogue = load_catalogue(args.patchsets)
    pins = load_pins(args.pins)
    definition = load_image(args.images, args.image, catalogue, pins)
    pin = get_pin(pins, args.pin, args.pins)
    if pin.name not in {p.name for p in image_pins(definition, pins)}:
        raise KilnError(f"{definition.path}: pin {pin.name} is not one this image is built for")
    return definition, pin, catalogue


def cmd_build(args) -> int:
    definition, pin, catalogue = load_build_inputs(args)
    outputs = Outputs(push=args.push, oci=args.oci, docker_archive=args.docker_archive, repository=args.repository,
                      values=args.values)
    config = config_from_options(args)
    result = build_image(definition, pin, args.sm, catalogue, outputs, config, args.allow_unlocked)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    where = ", ".join(result.outputs.values()) or "no output requested (digest only)"
    ui.stdout.print(
        f"built {result.repository}:{result.tag} {result.manifest_digest}\n"
        f"  base {result.base}@{result.base_digest}; layer {result.layer_digest} "
        f"({result.files_changed} file(s), {result.layer_size} bytes)\n"
        f"  pulled {result.bytes_pulled} bytes, pushed {result.bytes_pushed} bytes "
        f"in {result.timings.get('total', 0):.2f}s -> {where}"
    )
    if "push" in result.outputs:
        print(result.manifest_digest)
    return 0


def add_build_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("build", help="build a patched image for one pin and SM (pull, bake, publish)")
    add_target_options(p)
    p.add_argument("--push", action="store_true", help="push to the image's repository")
    p.add_argument("--oci", type=Path, metavar="DIR", help="write an OCI image layout to DIR")
    p.add_argument("--docker-archive", type=Path, metavar="FILE", help="write a docker-archive tarball (podman load)")
    p.add_argument("--values", type=Path, metavar="FILE", help="write the image's Helm values (JSON) to FILE")
    p.add_argument("--repository", help="destination repository instead of the image definition's")
    add_registry_options(p)
    p.add_argument("--allow-unlocked", action="store_true", help="build an unlocked or mismatching pin")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=cmd_build)
    return p
