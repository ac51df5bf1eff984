"""How a build finds its registry build cache entries (``build --cache-from``): the ``patched``
entry by probing, before any base layer is read; the ``kernels`` entry by its key.

Public API:
    PROBE_DEPTH, PROBE_THREADS
    CacheReader(cache_from, config, stats, budget, cache, reporter=SILENT, open_record=plain_record)
        .patched(inputs, layers, need_triton, platform) -> (CacheUse, CachedEntry) | None   the hit, if any
        .read(use, agrees=None) -> CachedEntry | None   ``use``'s entry from the first cache that has it verified
    look_up_entries(reader, inputs, base, pull, lap, leave_out_unusable_kernels=False) -> CacheLookup
        a build's ``patched``, ``kernels`` and ``catalogue`` entries: their keys, and what hit
    unsigned_use(uses, hits, reporter)   the one warning of a build that uses unsigned entries
    cached_catalogue(patchsets, cache_from, config, reporter=SILENT, open_record=plain_record, cache=None)
        -> (Catalogue of facts, where) | (loaded Catalogue, None) | None   the ``catalogue`` entry of these ``patchsets/`` bytes
    facts_difference(local, cached) -> str | None   the first patch field where two catalogues' facts differ

The ``patched`` key names the vLLM layers the walk reads (``kiln.image.cachekeys``), which are
known only once read. So the probe computes the key of each depth the walk may have stopped
at (the top 1, 2, … ``PROBE_DEPTH`` layers, and the whole base read to its bottom:
``probe_walks``) and asks every cache for each tag, ``PROBE_THREADS`` requests at a time (a
HEAD each; a GET only where one is there). A right entry exists at one depth at most: a
writer's walk stopped at its depth, and a walk over the same layers stops at the same one, so
an entry at another depth is another base's, whose walk this base's would not repeat. The
shallowest entry that verifies (``kiln.image.regcache``) is the hit; a cold build pays one
round of requests per ``PROBE_THREADS`` depths and reads nothing more. A base whose vLLM lies
deeper than ``PROBE_DEPTH`` layers is never probed that deep: its ``patched`` entry is not
written (its ``kernels`` entries still are: they are looked up after the walk).

The ``kernels`` key is known once the layers read are: from the ``patched`` hit's key, or from
the walk (the build pulls, then asks, before it compiles). So is the ``patched`` entry's other
key, by the source the walk read (``cachekeys.source_key``): a probe that missed (another
platform's layers, a rebuilt base) asks for it before it patches, so every platform and SM of
a pin patches once.

``look_up_entries`` is the whole of "is it cached" for a build (``kiln.image.prepare`` is "how
to build", as ko keeps its layer cache apart from its builder): it probes, and only when an
entry misses does it call the build's ``pull`` (the base's pristine vLLM, read from its top
layers), checks a hit against what the walk read, and keys what the build will write.

The ``catalogue`` entry is read first of all, before the definition is loaded: its key is the
bytes of ``patchsets/`` and kiln's code, known without importing anything. Only a signed entry
(verified with ``--cache-key``) stands in for the catalogue: an unsigned one could put any
title or target into the SBOM, so the catalogue is loaded and the entry compared with it (a
difference: a miss with a warning naming the patch and the field).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.image.cachekeys import (
    CATALOGUE,
    KERNELS,
    PATCHED,
    catalogue_key,
    entry_tag,
    kernels_key,
    patched_key,
    probe_walks,
    source_identity,
    source_key,
    walk_read,
)
from kiln.image.inputs import BuildInputs
from kiln.image.regcache import (
    CachedEntry,
    CacheUse,
    base_platform,
    patched_agrees,
    plain_record,
    read_entry,
    verify_entry,
)
from kiln.lifeline import uninterrupted
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import RemoteImage
from kiln.oci.limits import Budget
from kiln.oci.manifest import Descriptor
from kiln.oci.registry import RegistryClient, TransferStats
from kiln.patch.catalog import Catalogue, load_catalogue
from kiln.patch.facts import catalogue_facts, facts_catalogue
from kiln.patch.platforms import patched_files
from kiln.report import SILENT, Reporter
from kiln.source.image import ImageVllm, check_platform
from kiln.triton.cachelayer import image_env

PROBE_DEPTH = 32  # bounds a cold build's requests: at most 33 tags per cache
PROBE_THREADS = 4


class CacheReader:
    """The build's ``cache_from`` locations (``ImageReference`` without tag), tried in order."""

    def __init__(self, cache_from, config: RegistryConfig, stats: TransferStats, budget: Budget, cache: Path,
                 reporter: Reporter = SILENT, open_record=plain_record) -> None:
        self.locations = [(location, RegistryClient(config.endpoint(location.registry), stats=stats, budget=budget))
                          for location in cache_from]
        self.budget = budget
        self.workroot, self.reporter, self.open_record = cache / "build", reporter, open_record

    def patched(self, inputs: BuildInputs, layers: list[Descriptor], need_triton: bool,
                platform: dict) -> tuple[CacheUse, CachedEntry] | None:
        """The ``patched`` hit for a base of ``layers`` (bottom first), before any is read; one that
        differs from the selection its key covers or the base's ``platform`` is a miss
        (``regcache.patched_agrees``)."""
        uses = [CacheUse(PATCHED, *patched_key(inputs, walk, need_triton)) for walk in probe_walks(layers, PROBE_DEPTH)]
        jobs = [(use, location, client) for use in uses for location, client in self.locations]

        def find(job):  # a client of its own counts what it moved: the build's counts are not shared across threads
            use, location, client = job
            probe = RegistryClient(client.endpoint, client.session, client.auth, TransferStats(), budget=client.budget)
            try:
                return probe.find_manifest(location.repository, entry_tag(PATCHED, use.key)), probe.stats
            except KilnError as err:
                return err, probe.stats

        with ThreadPoolExecutor(max_workers=PROBE_THREADS) as pool:
            with uninterrupted():  # a signal inside submit could start a thread the pool never joins
                futures = [pool.submit(find, job) for job in jobs]
            found = []
            for (_, _, client), future in zip(jobs, futures, strict=True):
                manifest, moved = future.result()
                _add(client.stats, moved)
                found.append(manifest)
        failed = set()
        for (use, location, client), manifest in zip(jobs, found, strict=True):
            if isinstance(manifest, KilnError):
                if location.name not in failed:  # one warning per cache, not one per depth
                    failed.add(location.name)
                    self.reporter.warn(f"build cache {location.name}: not read, building without it: {manifest}")
                continue
            if manifest is None:
                continue
            with self._workdir() as workdir:
                entry = verify_entry(client, location.repository, manifest, PATCHED, use.key, use.inputs,
                                     Path(workdir), self.reporter, self.open_record,
                                     patched_agrees(use.inputs, platform))
            if entry is not None:
                use.hit, use.location = entry.where, location
                return use, entry
        for location, _ in self.locations:
            if location.name not in failed:
                self.reporter.note(f"build cache {location.name}: no patched entry for this build "
                                   f"({len(uses)} depths of the base's layers probed)")
        return None

    def read(self, use: CacheUse, agrees=None) -> CachedEntry | None:
        """``use``'s entry (its key known), from the first location whose entry verifies (and ``agrees``)."""
        for location, client in self.locations:
            with self._workdir() as workdir:
                entry = read_entry(client, location.repository, use.kind, use.key, use.inputs, Path(workdir),
                                   self.reporter, self.open_record, agrees)
            if entry is not None:
                use.hit, use.location = entry.where, location
                return entry
        return None

    def _workdir(self):
        self.workroot.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=self.workroot, prefix=".tmp-cache-")


@dataclass
class CacheLookup:
    """What the registry build cache holds for one build (``look_up_entries``): each entry it
    looks up (its key, where it hit) and, where one hit, the verified entry."""

    inputs: BuildInputs  # the build's, with the catalogue loaded when it patches or compiles
    found: ImageVllm | None  # the base's pristine vLLM; None when every entry hit (no layer read)
    patched: CacheUse
    patched_hit: CachedEntry | None
    kernels: CacheUse | None  # None: the definition declares no kernels
    kernels_hit: CachedEntry | None
    catalogue: CacheUse

    @property
    def uses(self) -> list[CacheUse]:
        """Every entry, as the ``--json`` summary's ``cache`` lists them."""
        return [self.patched, *([self.kernels] if self.kernels is not None else []), self.catalogue]

    @property
    def hits(self) -> list[CachedEntry]:
        return [hit for hit in (self.patched_hit, self.kernels_hit) if hit is not None]


def look_up_entries(reader: CacheReader, inputs: BuildInputs, base: RemoteImage, pull: Callable[[], ImageVllm],
                    lap: Callable[[str], None], leave_out_unusable_kernels: bool = False) -> CacheLookup:
    """A build's entries in ``reader``'s caches (none: only their keys, for ``--cache-to``).

    ``base``: the resolved base (its manifest and config are read, none of its layers);
    ``pull``: the build's own read of the pristine vLLM, called only when an entry misses (to
    patch or compile with); ``lap``: the build's clock (a ``cache`` step each time it asks).
    A ``patched`` entry is probed for before any layer is read, and on a miss asked for by its
    source once the walk has read it (``source_key``: another platform's or SM's patching of the
    same files); a ``catalogue`` hit stands in
    for the catalogue only while nothing is patched (one whose facts are not the loaded
    catalogue's refuses every hit); a ``patched`` hit that says the walk stops elsewhere than
    it did is refused; the ``kernels`` entry is asked for once its key is known."""
    kernels, reporter = inputs.definition.model.kernels, reader.reporter
    need_triton = bool(kernels)

    def kernels_use_of(layers_read: list[dict]) -> CacheUse:
        return CacheUse(KERNELS, *kernels_key(inputs, layers_read, image_env(base.config()),
                                              leave_out_unusable_kernels), sm=inputs.sm)

    patched_use = kernels_use = patched_hit = kernels_hit = None
    if reader.locations:  # the patched entry by the layers it was keyed by, before any is read
        check_platform(base.config(), base.name, inputs.platform)
        reader.budget.check_layers(base.name, len(base.layers()))
        if (found_hit := reader.patched(inputs, base.layers(), need_triton, base_platform(base.config()))) is not None:
            patched_use, patched_hit = found_hit
            patched_use.source = source_key(inputs, patched_hit.record["source"])
            if kernels:  # the walk that wrote it read down to Triton: the same layers hold it
                kernels_use = kernels_use_of(patched_use.inputs["vllm_layers"]["layers"])
                kernels_hit = reader.read(kernels_use)
        lap("cache")

    found = None
    if patched_hit is None or (kernels and kernels_hit is None):
        if inputs.catalogue_hit is not None:  # to patch or compile with: the catalogue itself
            facts = inputs
            inputs = inputs.with_loaded_catalogue()
            if catalogue_facts(inputs.catalogue) != catalogue_facts(facts.catalogue):
                reporter.warn(f"build cache entry {facts.catalogue_hit} refused, building without it: its "
                              f"facts are not those of {inputs.files.patchsets}")
                patched_use = patched_hit = kernels_use = kernels_hit = None
        found = pull()
        walk = walk_read(base.layers(), found.layers_read)
        if patched_hit is not None and patched_use.inputs["vllm_layers"]["layers"] != walk["layers"]:
            reporter.warn(f"build cache entry {patched_use.hit} refused, building without it: it says the "
                          f"walk stops after the top {len(patched_use.inputs['vllm_layers']['layers'])} layers; "
                          f"it read {len(walk['layers'])}")
            patched_use = patched_hit = kernels_use = None
        targets = patched_files(inputs.catalogue, inputs.definition.patches)
        source = source_identity(found.tree, found.site_dir, found.vllm_files, targets)
        if patched_hit is not None and patched_hit.record["source"] != source:
            reporter.warn(f"build cache entry {patched_use.hit} refused, building without it: the source "
                          "its record names is not the one the walk read")
            patched_use = patched_hit = None
        if patched_use is None:
            patched_use = CacheUse(PATCHED, *patched_key(inputs, walk, need_triton))
            patched_use.writable = len(walk["layers"]) <= PROBE_DEPTH  # deeper: no probe would find it
        patched_use.source = source_key(inputs, source)
        if patched_hit is None and reader.locations:  # the entry of the same source, any platform's or base's
            by_source = CacheUse(PATCHED, *patched_use.source)
            patched_hit = reader.read(by_source, patched_agrees(by_source.inputs, base_platform(base.config())))
            patched_use.hit, patched_use.location = by_source.hit, by_source.location
            lap("cache")
        if kernels and kernels_use is None:
            kernels_use = kernels_use_of(walk["layers"])
            if reader.locations:
                kernels_hit = reader.read(kernels_use)
                lap("cache")
    catalogue_use = CacheUse(CATALOGUE, *catalogue_key(inputs.files.patchsets), hit=inputs.catalogue_hit,
                             fields={"facts": catalogue_facts(inputs.catalogue)})
    return CacheLookup(inputs, found, patched_use, patched_hit, kernels_use, kernels_hit, catalogue_use)


def unsigned_use(uses: list[CacheUse], hits: list, reporter: Reporter) -> None:
    """The one line a build that uses unsigned registry cache entries says (``docs/TRUST.md``)."""
    unsigned = [(use, hit) for use in uses for hit in hits if use.hit == hit.where and not hit.signed]
    if unsigned:
        repos = sorted({use.location.name for use, _ in unsigned if use.location is not None})
        reporter.warn(f"build cache: using unsigned {' and '.join(use.kind for use, _ in unsigned)} "
                      f"entr{'ies' if len(unsigned) > 1 else 'y'} from {', '.join(repos)}: whoever can push there "
                      "can change its patched bytes undetected; --cache-key PUB (or [cache] require_signed) "
                      "takes signed entries only")


def cached_catalogue(patchsets: Path, cache_from, config: RegistryConfig, reporter: Reporter = SILENT,
                     open_record=plain_record, cache: Path | None = None) -> tuple[Catalogue, str | None] | None:
    """The catalogue's facts for exactly these ``patchsets`` bytes (and kiln's code), from the first
    of ``cache_from`` whose entry verifies and parses; None (a miss: the catalogue is loaded).
    ``cache``: the kiln cache (its ``build/`` holds the entry while it is checked).

    An unsigned entry (``open_record`` verifies no signature) is not used in the catalogue's
    place: the catalogue is loaded, the entry compared with it (a difference is a warning naming
    the patch and field), and ``(the loaded catalogue, None)`` returned (not a hit)."""
    if not cache_from or not patchsets.is_dir():  # (a missing catalogue: load_catalogue says so)
        return None
    use = CacheUse(CATALOGUE, *catalogue_key(patchsets))
    reader = CacheReader(cache_from, config, TransferStats(), Budget(config.limits), cache or cache_root(),
                         reporter, open_record)
    entry = reader.read(use)
    if entry is None:
        return None
    try:
        facts = facts_catalogue(patchsets, entry.record["facts"], f"build cache entry {entry.where}")
    except KilnError as err:
        reporter.warn(f"{err}; loading the catalogue instead")
        return None
    if entry.signed:
        return facts, entry.where
    local = load_catalogue(patchsets)  # imports every patch module (libcst): what a signed entry spares
    difference = facts_difference(catalogue_facts(local), catalogue_facts(facts))
    if difference:
        reporter.warn(f"build cache entry {entry.where} refused, building without it: its facts differ from "
                      f"{patchsets}: {difference}")
    return local, None


def facts_difference(local: dict, cached: dict) -> str | None:
    """The first field where ``cached`` facts (``catalogue_facts``) differ from ``local``'s; None when equal."""
    if local == cached:
        return None
    for pid in sorted(set(local["patches"]) | set(cached["patches"])):
        mine, theirs = local["patches"].get(pid), cached["patches"].get(pid)
        named = pid if pid.isprintable() else repr(pid)  # on one line
        if mine is None or theirs is None:
            return f"patch {named} is {'not in the catalogue' if mine is None else 'missing'}"
        for name in sorted(set(mine) | set(theirs)):
            if mine.get(name) != theirs.get(name):
                return f"patch {named} {name} is {theirs.get(name)!r}, the catalogue's {mine.get(name)!r}"
        if local["digests"].get(pid) != cached["digests"].get(pid):
            return f"patch {named} sha256 is {cached['digests'].get(pid)!r}, the catalogue's {local['digests'].get(pid)}"
    return "its facts are not the catalogue's"


def _add(stats: TransferStats, moved: TransferStats) -> None:
    for name in (f.name for f in fields(TransferStats)):
        setattr(stats, name, getattr(stats, name) + getattr(moved, name))
