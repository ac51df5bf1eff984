"""Everything a build decides before it writes anything: the base, the patched source, the layers.

Public API:
    PreparedBuild      the resolved base, the verdicts, kiln's layers (``LayerContents``), labels
    prepare_build(inputs, registry_config=None, allow_unlocked=False, cache=None,
                  reporter=SILENT, leave_out_unusable_kernels=False, cache_from=(),
                  open_record=plain_record, keep_wheels=None, shared=None) -> PreparedBuild
    Clock              seconds spent per step, for ``--json`` and the benchmarks

Steps: resolve the pin's base reference to a digest (one manifest HEAD) and check it against
the pin's lock (``resolve_base``); ask the registry build caches what they hold
(``kiln.image.cachelookup.look_up_entries``, "is it cached", kept apart from "how to build"
as ko keeps its layer cache), which reads the pristine ``vllm/`` from only the top layers that
hold it (``ImageSource``) when an entry misses; run the image's patch selection on it, or
reuse what ``kiln.patch.memo`` remembers of it (a patch whose verdict blocks a build stops it
here, naming the patch: ``patch_source``); decide the patched-source layer, the audit file
(``audit_layer``) and, when the definition declares kernels, the Triton cache layer (compiled
beside the rest of the patching once the patches of the files the kernels compile from are done:
``kernels_of``); decide the labels. With ``cache_from`` (``kiln.image.regcache``), a verified
``patched`` entry replaces the patching and a ``kernels`` entry the compiling; when both hit,
the base's manifest and config are read, none of its layers. The patched-source layer is
assembled the same way from the patching or the entry. Baking the layers into an image
(``kiln.image.image``) and the Dockerfile context (``kiln.publish.context``) both start from
this one value, so they cannot drift apart.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from kiln import labels as L
from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.image.cachelookup import CacheLookup, CacheReader, look_up_entries, unsigned_use
from kiln.image.inputs import BuildInputs
from kiln.image.layers import audit_record, source_contents, with_audit
from kiln.image.platform import check_base_platform, check_base_triton
from kiln.image.provenance import kiln_revision, kiln_source_url
from kiln.image.regcache import base_platform, plain_record
from kiln.image.wheelcache import RegistryWheels
from kiln.lifeline import uninterrupted
from kiln.oci.blobcache import BlobCache
from kiln.oci.digest import sha256_text
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import RemoteImage
from kiln.oci.layer import LayerContents
from kiln.oci.limits import Budget
from kiln.oci.mutate import ImageModel, to_oci
from kiln.oci.reference import ImageReference, parse_reference
from kiln.oci.registry import RegistryClient, TransferStats
from kiln.patch.outcome import Outcome, Verdict
from kiln.pausepoint import pause_point
from kiln.pins import Pin
from kiln.report import SILENT, Reporter
from kiln.source.image import ImageSource, ImageVllm
from kiln.targets import split_platform
from kiln.triton.aot import reads_source
from kiln.triton.cachelayer import image_env, kernel_created_by, triton_cache_layer


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
        self.timings[name] = round(self.timings.get(name, 0) + now - self._mark, 3)  # a step may come twice
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
    base_manifest_digest: str = ""  # the platform's manifest built on (inputs.platform)
    cache: list = field(default_factory=list)  # the registry build cache entries looked up (regcache.CacheUse)
    cache_mounts: dict = field(default_factory=dict)  # layer digest -> the cache repository it came from (a push mounts it)
    wheels: RegistryWheels = field(default_factory=lambda: RegistryWheels([]))  # the toolchain wheel read from or kept for the registry cache
    warm: dict = field(default_factory=dict)  # the warm layer's summary (kiln.warm.bake), if any

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


def resolve_base(inputs: BuildInputs, config: RegistryConfig, cache: Path, stats: TransferStats, reporter: Reporter,
                 budget: Budget | None, allow_unlocked: bool) -> tuple[ImageReference, str, ImageSource, RemoteImage]:
    """The pin's base: its reference, the digest it resolves to (one manifest HEAD, checked against
    the pin's lock), the source that reads its vLLM at that digest, and the image (the build's
    platform's manifest, checked against the pin's record)."""
    pin = inputs.pin
    base_ref = parse_reference(pin.image)
    source = ImageSource(base_ref, expected_version=pin.vllm, registry_config=config, cache=cache, stats=stats,
                         reporter=reporter, budget=budget, need_triton=bool(inputs.definition.model.kernels),
                         platform=inputs.platform)
    resolved = base_ref.digest or source.client.resolve(base_ref.repository, base_ref.ref)
    check_lock(pin, resolved, allow_unlocked, reporter)
    source.reference = base_ref.pinned(resolved)  # what it reads, if the registry cache leaves it anything to
    base = RemoteImage(base_ref.pinned(resolved), source.client, BlobCache(cache / "blobs"),
                       platform=split_platform(inputs.platform), manifest_cache=cache / "manifests")
    check_base_platform(pin, resolved, base, inputs.platform)  # before any layer is read
    return base_ref, resolved, source, base


def prepare_build(inputs: BuildInputs, registry_config: RegistryConfig | None = None,
                  allow_unlocked: bool = False, cache: Path | None = None,
                  reporter: Reporter = SILENT, budget: Budget | None = None,
                  leave_out_unusable_kernels: bool = False, cache_from=(), open_record=plain_record,
                  keep_wheels: Path | None = None, shared: dict | None = None) -> PreparedBuild:
    """Resolve and check the base, read its pristine vLLM, patch it, and decide kiln's layers.

    ``budget``: the command's limits (its deadline running; None: a new one); ``cache_from``:
    registry build caches (``ImageReference`` without tag) tried in order;
    ``open_record``: how an entry's record is opened (and its signature checked: the pipeline's);
    ``keep_wheels``: where a Triton wheel fetched from the index is kept (for ``--cache-to``);
    ``shared``: the patch runs of the tag's platforms before this one (``patch_source``)."""
    definition, sm, kernels = inputs.definition, inputs.sm, inputs.definition.model.kernels
    config = registry_config or RegistryConfig.load()
    cache = cache or cache_root()

    # 1. resolve the base and check the lock
    stats = TransferStats()
    clock = Clock(reporter, lambda: stats.bytes_down)
    base_ref, resolved, source, base = resolve_base(inputs, config, cache, stats, reporter, budget, allow_unlocked)
    clock.lap("resolve")

    # 2. what the registry build cache holds; the pristine vLLM (top layers only) when an entry missed
    def pull() -> ImageVllm:
        found = source.pull()
        check_base_triton(sm, found, inputs.pin)
        clock.lap("pull")
        return found

    reader = CacheReader(cache_from, config, stats, source.client.budget, cache, reporter, open_record)
    cached = look_up_entries(reader, inputs, base, pull, clock.lap, leave_out_unusable_kernels)
    inputs = cached.inputs
    # One flavour for every output (skopeo's layout reader ignores Docker v2 manifests).
    base_model = to_oci(ImageModel.from_base(base.manifest(), base.config_bytes()))

    # 3. patch (a selection patched before on exactly this source, code and target is reused),
    # with the Triton kernels compiling beside it once the files they read are patched
    runtime_env = {**image_env(base.config()), **definition.serve_env}
    wheels = RegistryWheels([(RegistryClient(config.endpoint(loc.registry), stats=stats, budget=source.client.budget),
                              loc.repository) for loc in cache_from], keep_wheels, reporter)

    def kernel_layer(changed: dict[str, str]):
        return triton_cache_layer(kernels, sm, cached.found, changed, runtime_env, cache,
                                  f"{definition.path}: model.kernels", definition.name, reporter,
                                  leave_out_unusable_kernels, wheels, inputs.platform)

    with ThreadPoolExecutor(max_workers=1) as pool:
        compile = _KernelCompile(kernels, kernel_layer, pool, bool(kernels) and cached.kernels_hit is None)
        patching = patch_source(inputs, cached, base_ref, cache, clock, compile.start, compile.reads, shared)
        cached.patched.fields = {
            "vllm_version": patching.vllm_version, "site_dir": patching.site_dir,
            "outcomes": [o.to_json() for o in patching.outcomes.values()], "applied": patching.applied,
            "before": patching.before, "platform": base_platform(base.config()), "source": cached.patched.source[1]["source"],
            "modules": {p["id"]: p["sha256"] for p in cached.patched.inputs["patches"]}}
        cached.patched.contents = [patching.layer]

        # 4. what kiln's layers hold, and the image's labels
        kernel_layers, env, triton, mounts = kernels_of(inputs, cached, lambda: compile.result(patching.changed),
                                                        clock)
        layers = [audit_layer(inputs, base_ref, resolved, patching), *kernel_layers]
    labels = image_labels(inputs, base_ref, resolved, patching.applied, patching.vllm_version)
    unsigned_use(cached.uses, cached.hits, reporter)
    return PreparedBuild(
        inputs=inputs, base_ref=base_ref, base_digest=resolved, found=cached.found, base=base, base_model=base_model,
        client=source.client, stats=stats, outcomes=patching.outcomes, applied=patching.applied,
        files_changed=len(patching.changed), layers=layers, labels=labels, clock=clock, env=env, triton=triton,
        vllm_version=patching.vllm_version, site_dir=patching.site_dir, base_manifest_digest=base.manifest().digest,
        cache=cached.uses, cache_mounts=mounts, wheels=wheels,
    )


class _KernelCompile:
    """A build's Triton kernel compile (``compile_layer(changed)``, in ``pool``'s thread when begun
    early): begun beside the patching once it is handed the patched text of every file the
    kernels read (``start``: the patching's ``forked`` hook, with ``reads`` its ``first``), else
    run after it (``result``). ``wanted``: the build compiles (kernels declared, no cache entry)."""

    def __init__(self, preset, compile_layer, pool: ThreadPoolExecutor, wanted: bool):
        self.preset, self.compile_layer, self.pool, self.wanted = preset, compile_layer, pool, wanted
        self.early = None  # (the files handed, the compile's future)

    def reads(self, rel: str) -> bool:  # a file the kernels compile from
        return bool(self.preset) and reads_source(self.preset, rel)

    def start(self, changed: dict[str, str]) -> bool:
        """Begun (the patch processes then make way for it: ``kiln.patch.memo.YIELD_NICE``)?"""
        if self.wanted:
            with uninterrupted():  # a signal inside submit could start a thread the pool never joins
                self.early = (changed, self.pool.submit(self.compile_layer, changed))
        return self.wanted

    def result(self, changed: dict[str, str]):
        """The layer (or None: left out) for the patching's final ``changed`` files, and whether it
        was compiled beside the patching (the wait for it): only if it was handed their final text."""
        if self.early:
            handed, future = self.early
            if handed == {rel: text for rel, text in changed.items() if self.reads(rel)}:
                return future.result(), True
            future.exception()  # a group read another's output and the text changed: its wait, no result
        return self.compile_layer(changed), False


@dataclass(frozen=True)
class Patching:
    """The patching's result, run or read from the ``patched`` entry: each patch's outcome, the
    changed files (and each one's pristine sha256), vLLM's version and site dir, the layer."""

    outcomes: dict[str, Outcome]
    changed: dict[str, str]  # path under the site dir -> the patched text
    before: dict[str, str]  # path -> the pristine file's sha256
    vllm_version: str
    site_dir: str
    layer: LayerContents  # the patched-source layer, before its baked files and audit file

    @property
    def applied(self) -> list[str]:
        return [pid for pid, o in self.outcomes.items() if o.verdict is Verdict.APPLIES]


def patch_source(inputs: BuildInputs, cached: CacheLookup, base_ref: ImageReference, cache: Path, clock: Clock,
                 forked, first, shared: dict | None = None) -> Patching:
    """The image's patch selection run on the pristine source (``forked``: called with the patched
    text of the files ``first`` accepts once the patching has forked its processes and patched
    those: ``kiln.patch.memo.patched_selection``), or the ``patched`` entry's result, or the run of another platform
    of the tag on the same source (``shared``: source key -> (platform, Patching), this one's
    added); a verdict that blocks a build stops it."""
    hit = cached.patched_hit
    if hit is not None:  # the entry's: verified, keyed by the layers this base's walk reads and this selection
        record = hit.record
        return Patching(hit.outcomes, hit.changed(), dict(record["before"]), str(record["vllm_version"]),
                        str(record["site_dir"]), hit.layers[0])
    shared = {} if shared is None else shared
    source_key = cached.patched.source[0]
    if source_key in shared:  # the same pristine files, selection and target: the same result, byte for byte
        cached.patched.shared, patching = shared[source_key]
        return patching
    patching = _patched(inputs, cached, base_ref, cache, clock, forked, first)
    shared[source_key] = (inputs.platform, patching)
    return patching


def _patched(inputs: BuildInputs, cached: CacheLookup, base_ref: ImageReference, cache: Path, clock: Clock,
             forked, first) -> Patching:
    found, pin = cached.found, inputs.pin
    tree = found.tree
    result = patched_selection(inputs.catalogue, tree, inputs.target(), list(inputs.definition.patches),
                               cache, forked, first)
    for outcome in result.outcomes.values():
        if outcome.verdict.blocks_build:
            raise KilnError(
                f"patch {outcome.patch_id} is {outcome.verdict} on {pin.name} ({base_ref}): {outcome.detail}"
            )
    changed = result.changed_text()
    before = {rel: sha256_text(tree.read(rel)) for rel in changed if tree.exists(rel)}
    patching = Patching(result.outcomes, changed, before, str(tree.vllm_version), found.site_dir,
                        source_contents(changed, found.site_dir, found.vllm_files))
    clock.lap("patch")
    pause_point("patch")
    return patching


def audit_layer(inputs: BuildInputs, base_ref: ImageReference, resolved: str, patching: Patching) -> LayerContents:
    """The patched-source layer with the definition's baked files and the audit file."""
    definition, pin, sm = inputs.definition, inputs.pin, inputs.sm
    pin_json = {"name": pin.name, "image": pin.image, "vllm": str(pin.vllm), "cuda": pin.cuda,
                "digest": pin.digest or None}
    audit = audit_record(image=definition.name, pin=pin_json, sm=sm, base_reference=str(base_ref),
                         base_digest=resolved, site_dir=patching.site_dir, outcomes=patching.outcomes,
                         before=patching.before, changed=patching.changed, baked=definition.files,
                         images_dir=inputs.files.images.name)
    return with_audit(
        patching.layer, audit, baked=definition.files,
        created_by=f"kiln bake {definition.name} {pin.name} sm{sm}: {','.join(patching.applied) or 'no patch'}")


def kernels_of(inputs: BuildInputs, cached: CacheLookup, compiled, clock: Clock):
    """The Triton kernel cache layers (none or one), the config Env and summary they come with, and
    where a reused layer is mounted from: the ``kernels`` entry's, else ``compiled()``'s (the
    compile, or the wait for it when it ran beside the patching, and which)."""
    definition, sm, hit = inputs.definition, inputs.sm, cached.kernels_hit
    layers: list[LayerContents] = []
    env: dict[str, str] = {}
    triton: dict = {}
    mounts: dict[str, ImageReference] = {}
    if hit is not None:
        env, triton = dict(hit.record["env"]), dict(hit.record["triton"])
        if hit.layers:  # the history line names this image
            layers.append(replace(hit.layers[0], created_by=kernel_created_by(
                definition.name, sm, triton.get("kernel_names") or [])))
            mounts[hit.record["layers"][0]["digest"]] = cached.kernels.location
    elif definition.model.kernels:  # the ahead-of-time Triton kernel cache, one layer per SM
        # (when it compiled beside the patching, this lap is only the wait for it)
        done, beside = compiled()
        if done is None:  # the image could not use it, and the build was told to leave it out
            triton = {"sm": sm, "left_out": True, "keyed_for_image": False}
        else:
            layers.append(done.contents)
            env, triton = done.env, {**done.summary, "beside_patching": beside}
        clock.lap("triton")
    if definition.model.kernels:
        cached.kernels.fields, cached.kernels.contents = {"env": env, "triton": triton}, list(layers)
    return layers, env, triton, mounts


def patched_selection(catalogue, tree, target, selection: list[str], cache: Path, forked=None, first=None):
    """``kiln.patch.memo.patched_selection`` with the memo in ``cache``, imported only when a build
    patches: the patching imports libcst (0.3 s), which a build served from its cache goes without."""
    from kiln.patch.memo import SelectionMemo
    from kiln.patch.memo import patched_selection as run

    return run(catalogue, tree, target, selection, SelectionMemo(cache), forked=forked, first=first)


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
