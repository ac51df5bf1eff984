"""Everything a build decides before it writes anything: the base, the patched source, the layers.

Public API:
    PreparedBuild      the resolved base, the verdicts, kiln's layers (``LayerContents``), labels
    prepare_build(inputs, registry_config=None, allow_unlocked=False, cache=None,
                  reporter=SILENT, leave_out_unusable_kernels=False, cache_from=(),
                  open_record=plain_record) -> PreparedBuild
    Clock              seconds spent per step, for ``--json`` and the benchmarks

Steps: resolve the pin's base reference to a digest (one manifest HEAD) and check it against
the pin's lock; read the pristine ``vllm/`` from only the top layers that hold it
(``ImageSource``); run the image's patch selection on it, or reuse what ``kiln.patch.memo``
remembers of it (a patch whose verdict blocks a build stops it here, naming the patch); decide
the patched-source layer, the audit file and, when the definition declares kernels, the
Triton cache layer (compiled beside the patching when no selected patch touches the files the
kernels are compiled from); decide the labels. With ``cache_from`` (registry build caches,
``kiln.build.regcache``), a verified entry for this build's key replaces the pull, the patching
and the compiling: the base's manifest and config are read, none of its layers. Baking the layers into
an image (``kiln.build.image``) and the Dockerfile context (``kiln.publish.context``) both start
from this one value, so they cannot drift apart.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kiln import labels as L
from kiln.build.inputs import BuildInputs
from kiln.build.layers import audit_record, patched_contents
from kiln.build.provenance import kiln_revision, kiln_source_url
from kiln.build.regcache import CachedBuild, cache_key, plain_record, read_entry
from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.lifeline import uninterrupted
from kiln.oci.blobcache import BlobCache
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import RemoteImage
from kiln.oci.layer import LayerContents
from kiln.oci.limits import Budget
from kiln.oci.mutate import ImageModel, to_oci
from kiln.oci.reference import ImageReference, parse_reference
from kiln.oci.registry import RegistryClient, TransferStats
from kiln.patch.memo import SelectionMemo, patched_selection
from kiln.patch.model import Outcome, Verdict
from kiln.pausepoint import pause_point
from kiln.pins import Pin
from kiln.report import SILENT, Reporter
from kiln.source.image import ImageSource, ImageVllm
from kiln.triton.aot import reads_source
from kiln.triton.cachelayer import image_env, triton_cache_layer


class Clock:
    """Seconds spent in each step, for ``--json`` and the benchmarks; each step is reported as a
    stage with the bytes it moved (``pulled()``'s growth over the step, unless given)."""

    def __init__(self, reporter: Reporter = SILENT, pulled=lambda: 0) -> None:
        self.started = self._mark = time.monotonic()
        self.timings: dict[str, float] = {}
        self._reporter, self._pulled = reporter, pulled
        self._bytes_mark = pulled()

    def lap(self, name: str, nbytes: int | None = None) -> None:
        now, pulled = time.monotonic(), self._pulled()
        self.timings[name] = round(now - self._mark, 3)
        self._reporter.stage(name, now - self._mark, pulled - self._bytes_mark if nbytes is None else nbytes)
        self._mark, self._bytes_mark = now, pulled

    def total(self) -> dict[str, float]:
        self.timings["total"] = round(time.monotonic() - self.started, 3)
        return self.timings


@dataclass
class PreparedBuild:
    """The decisions of a build, before any output is written."""

    inputs: BuildInputs
    base_ref: ImageReference  # the pin's reference, as written
    base_digest: str  # what it resolved to (the digest a pin locks)
    found: ImageVllm | None  # None when a registry cache entry stood in for the pull
    base: RemoteImage
    base_model: ImageModel  # the base, as an OCI image model
    client: RegistryClient  # the base registry's client (reused for a same-host push)
    stats: TransferStats
    outcomes: dict[str, Outcome]
    applied: list[str]
    files_changed: int
    layers: list[LayerContents]  # kiln's layers over the base, bottom first
    labels: dict[str, str]  # config labels (and manifest annotations) of the image
    clock: Clock
    env: dict[str, str] = field(default_factory=dict)  # config Env entries kiln sets (TRITON_CACHE_DIR)
    triton: dict = field(default_factory=dict)  # the kernel cache layer's summary, if any
    vllm_version: str = ""  # the base's vLLM, as its source says
    site_dir: str = ""  # where vllm/ lives in the image, e.g. usr/local/lib/python3.12/dist-packages
    base_manifest_digest: str = ""  # the linux/amd64 manifest built on
    cache_key: str = ""  # the registry build cache's key of this build (kiln.build.regcache)
    cache_inputs: dict = field(default_factory=dict)  # what the key hashes
    cache_hit: str = ""  # registry/repository:tag of the cache entry used, if one was
    cached_from: ImageReference | None = None  # the cache repository kiln's layers came from (a push mounts them)

    @property
    def tag(self) -> str:
        return self.inputs.tag

    @property
    def base_by_digest(self) -> str:
        """``registry/repository@sha256:…``: the base as a Dockerfile's ``FROM`` must name it."""
        return f"{self.base_ref.name}@{self.base_digest}"


def check_lock(pin: Pin, resolved: str, allow_unlocked: bool, reporter: Reporter = SILENT) -> None:
    """A build uses the digest the pin is locked to, unless told otherwise (then it says so)."""
    if not pin.locked:
        if not allow_unlocked:
            raise KilnError(
                f"pin {pin.name} is not locked ({pin.image} now resolves to {resolved}); run "
                f"`build.py pin lock {pin.name}` to lock it, or pass --allow-unlocked"
            )
        reporter.warn(f"pin {pin.name} is unlocked; building {pin.image}@{resolved}")
    elif pin.digest != resolved:
        if not allow_unlocked:
            raise KilnError(
                f"pin {pin.name} is locked to {pin.digest} but {pin.image} now resolves to {resolved}; "
                "review the new base and re-lock the pin, or pass --allow-unlocked"
            )
        reporter.warn(f"pin {pin.name} lock differs; building {pin.image}@{resolved}")


def prepare_build(inputs: BuildInputs, registry_config: RegistryConfig | None = None,
                  allow_unlocked: bool = False, cache: Path | None = None,
                  reporter: Reporter = SILENT, budget: Budget | None = None,
                  leave_out_unusable_kernels: bool = False, cache_from=(), open_record=plain_record) -> PreparedBuild:
    """Resolve and check the base, read its pristine vLLM, patch it, and decide kiln's layers.

    ``budget``: the command's limits (its deadline already running); a new one when None.
    ``cache_from``: registry build caches (``ImageReference`` without tag) tried in order;
    ``open_record``: how an entry's record is opened (and its signature checked: the pipeline's)."""
    definition, pin, sm = inputs.definition, inputs.pin, inputs.sm
    config = registry_config or RegistryConfig.load()
    cache = cache or cache_root()

    # 1. resolve the base and check the lock
    base_ref = parse_reference(pin.image)
    stats = TransferStats()
    clock = Clock(reporter, lambda: stats.bytes_down)
    source = ImageSource(base_ref, expected_version=pin.vllm, registry_config=config, cache=cache, stats=stats,
                         reporter=reporter, budget=budget, need_triton=bool(definition.model.kernels))
    resolved = base_ref.digest or source.client.resolve(base_ref.repository, base_ref.ref)
    check_lock(pin, resolved, allow_unlocked, reporter)
    key, key_inputs = cache_key(inputs, resolved, leave_out_unusable_kernels)
    clock.lap("resolve")
    for location in cache_from:
        client = RegistryClient(config.endpoint(location.registry), stats=stats, budget=source.client.budget)
        (cache / "build").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache / "build", prefix=".tmp-cache-") as workdir:
            cached = read_entry(client, location.repository, key, key_inputs, Path(workdir), reporter, open_record)
        if cached is not None:
            base = RemoteImage(base_ref.pinned(resolved), source.client, BlobCache(cache / "blobs"),
                               manifest_cache=cache / "manifests")
            if base.manifest().digest != cached.record["base_manifest_digest"]:
                reporter.warn(f"build cache entry {cached.where} refused, building without it: "
                              "it was built on another base manifest")
                continue
            prepared = _from_cache(inputs, base_ref, resolved, base, source.client, stats, clock, cached,
                                   key, key_inputs)
            prepared.cached_from = location
            return prepared

    # 2. the pristine vLLM, from the top layers of the base only
    source.reference = base_ref.pinned(resolved)
    found = source.pull()
    base = RemoteImage(base_ref.pinned(resolved), source.client, BlobCache(cache / "blobs"),
                       manifest_cache=cache / "manifests")
    base_config = base.config()
    # One flavour for every output (skopeo's layout reader ignores Docker v2 manifests).
    base_model = to_oci(ImageModel.from_base(base.manifest(), base.config_bytes()))
    clock.lap("pull")

    # 3. patch (a selection patched before on exactly this source, code and target is reused),
    # with the Triton kernels compiling beside it when no selected patch touches their sources
    tree = found.tree
    kernels = definition.model.kernels
    runtime_env = {**image_env(base_config), **definition.serve_env}

    def kernel_layer(changed: dict[str, str]):
        return triton_cache_layer(kernels, sm, found, changed, runtime_env, cache,
                                  f"{definition.path}: model.kernels", definition.name, reporter,
                                  leave_out_unusable_kernels)

    selected = inputs.catalogue.closure(list(definition.patches))
    beside = bool(kernels) and not any(reads_source(kernels, rel) for pid in selected
                                       for rel in inputs.catalogue.get(pid).targets)
    early = []  # the kernels' future, once the patching has forked its processes

    def start_kernels() -> None:
        if beside:  # reads only files no patch changes
            with uninterrupted():  # a signal inside submit could start a thread the pool never joins
                early.append(pool.submit(kernel_layer, {}))

    with ThreadPoolExecutor(max_workers=1) as pool:
        result = patched_selection(inputs.catalogue, tree, inputs.target(), list(definition.patches),
                                   SelectionMemo(cache), forked=start_kernels)
        for outcome in result.outcomes.values():
            if outcome.verdict.blocks_build:
                raise KilnError(
                    f"patch {outcome.patch_id} is {outcome.verdict} on {pin.name} ({base_ref}): {outcome.detail}"
                )
        changed = result.changed_text()
        before = {rel: tree.read(rel) for rel in changed if tree.exists(rel)}
        applied = [pid for pid, o in result.outcomes.items() if o.verdict is Verdict.APPLIES]
        clock.lap("patch")
        pause_point("patch")

        # 4. what kiln's layers hold, and the image's labels
        pin_json = {"name": pin.name, "image": pin.image, "vllm": str(pin.vllm), "cuda": pin.cuda,
                    "digest": pin.digest or None}
        audit = audit_record(image=definition.name, pin=pin_json, sm=sm, base_reference=str(base_ref),
                             base_digest=resolved, site_dir=found.site_dir, outcomes=result.outcomes,
                             before=before, changed=changed, baked=definition.files,
                             images_dir=inputs.files.images.name)
        layers = [patched_contents(
            changed, found.site_dir, found.vllm_files, audit,
            created_by=f"kiln bake {definition.name} {pin.name} sm{sm}: {','.join(applied) or 'no patch'}",
            baked=definition.files)]
        env: dict[str, str] = {}
        triton: dict = {}
        if kernels:  # the ahead-of-time Triton kernel cache, one layer per SM
            # (when it compiled beside the patching, this lap is only the wait for it)
            done = early[0].result() if early else kernel_layer(changed)
            if done is None:  # the image could not use it, and the build was told to leave it out
                triton = {"sm": sm, "left_out": True, "keyed_for_image": False}
            else:
                layers.append(done.contents)
                env, triton = done.env, {**done.summary, "beside_patching": beside}
            clock.lap("triton")
    labels = image_labels(inputs, base_ref, resolved, applied, str(tree.vllm_version))
    return PreparedBuild(
        inputs=inputs, base_ref=base_ref, base_digest=resolved, found=found, base=base, base_model=base_model,
        client=source.client, stats=stats, outcomes=result.outcomes, applied=applied,
        files_changed=len(changed), layers=layers, labels=labels, clock=clock, env=env, triton=triton,
        vllm_version=str(tree.vllm_version), site_dir=found.site_dir, base_manifest_digest=found.manifest_digest,
        cache_key=key, cache_inputs=key_inputs,
    )


def image_labels(inputs: BuildInputs, base_ref: ImageReference, resolved: str, applied: list[str],
                 vllm_version: str) -> dict[str, str]:
    """The image's labels (and manifest annotations): the same whether built or read from a cache."""
    labels = {
        L.BASE_NAME: str(base_ref),
        L.BASE_DIGEST: resolved,
        L.VERSION: inputs.tag,
        L.IMAGE: inputs.definition.name,
        L.PIN: inputs.pin.name,
        L.SM: str(inputs.sm),
        L.PATCHES: ",".join(applied),
        L.VLLM: vllm_version,
    }
    commit, _ = kiln_revision()
    if commit:
        labels[L.REVISION] = commit
    source_url = kiln_source_url()
    if source_url:
        labels[L.SOURCE] = source_url
    return labels


def _from_cache(inputs: BuildInputs, base_ref: ImageReference, resolved: str, base: RemoteImage,
                client: RegistryClient, stats: TransferStats, clock: Clock, cached: CachedBuild,
                key: str, key_inputs: dict) -> PreparedBuild:
    """The prepared build a verified cache entry gives: no layer of the base read, nothing patched."""
    record = cached.record
    base_model = to_oci(ImageModel.from_base(base.manifest(), base.config_bytes()))
    clock.lap("cache")
    applied = [str(pid) for pid in record["applied"]]
    return PreparedBuild(
        inputs=inputs, base_ref=base_ref, base_digest=resolved, found=None, base=base, base_model=base_model,
        client=client, stats=stats, outcomes=cached.outcomes, applied=applied,
        files_changed=int(record["files_changed"]), layers=cached.layers,
        labels=image_labels(inputs, base_ref, resolved, applied, str(record["vllm_version"])), clock=clock,
        env=dict(record["env"]), triton=dict(record["triton"]), vllm_version=str(record["vllm_version"]),
        site_dir=str(record["site_dir"]), base_manifest_digest=base.manifest().digest,
        cache_key=key, cache_inputs=key_inputs, cache_hit=cached.where,
    )
