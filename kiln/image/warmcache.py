"""The registry build cache's ``warm`` entry: a warm layer that travels between machines.

Public API:
    with_warm_entry(prepared, bundle_bytes) -> PreparedBuild   the entry of the bundle baked on top (``--cache-to``)
    cached_warm(prepared, cache_from, config, budget, cache, reporter=SILENT, open_record=plain_record)
        -> PreparedBuild    ``build --warm-from-cache``: the entry of this build's warm key baked on top

A CI job that warmed an image once, on a machine that can boot it, pushes the bundle with its
build (``build --warm DIR --cache-to REGISTRY/REPO``); a later build of the same inputs, on any
machine, takes it from the cache (``build --warm-from-cache --cache-from REGISTRY/REPO``) instead
of booting vLLM again. The entry is keyed by the warm key itself (``kiln.image.warmlayer``: the
base's digest, vLLM, the platform, the SM, the patch set and each patched file's sha256, the model,
the serve args and env), not by kiln's code as the other entries are: what vLLM compiled depends
on those inputs, not on how kiln writes a layer, and a layer kiln would now write otherwise does
not re-derive from its contents, so its read misses anyway.

The entry's layer is the warm layer; its record holds the bundle's ``warm.json`` bytes
(``bundle``), so a hit bakes the image the bundle's folder bakes (the record's sha256 is in the
audit file, the SBOM and the provenance). Read verified as every entry (``kiln.image.regcache``:
every digest, the record's kind, key and inputs, which are the key's factors, the layer
re-derived from its contents; with ``--cache-key`` its signature), then compared with what the
build knows (``_agrees``): the bundle's key and factors are the entry's, its files are the layer's
by sha256. An unsigned hit is used with a warning (its compiled code is trusted to whoever can
push to the cache). Anything wrong is a miss with a warning; a build that asked for the cached warm layer
and found none is built without one, with one warning line naming the key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from kiln.errors import KilnError
from kiln.image.cachekeys import WARM
from kiln.image.cachelookup import CacheReader
from kiln.image.layers import AUDIT_PATH
from kiln.image.prepare import PreparedBuild
from kiln.image.regcache import CachedEntry, CacheUse, plain_record
from kiln.image.warmlayer import bake_warm, bundle_summary, key_factors, warm_key
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.limits import Budget
from kiln.report import SILENT, Reporter


def _use(key: str, factors: dict, bundle_bytes: bytes | None = None, prepared: PreparedBuild | None = None) -> CacheUse:
    use = CacheUse(WARM, key.removeprefix("sha256:"), factors)
    if prepared is not None and bundle_bytes is not None:
        use.fields, use.contents = {"bundle": bundle_bytes.decode("utf-8")}, [prepared.layers[-1]]
    return use


def with_warm_entry(prepared: PreparedBuild, bundle_bytes: bytes) -> PreparedBuild:
    """``prepared`` (its warm layer on top, the bundle's key checked) with the ``warm`` entry that
    ``--cache-to`` writes: the layer already baked, the record the bundle's bytes."""
    record = json.loads(bundle_bytes)
    return replace(prepared, cache=[*prepared.cache, _use(record["key"], record["factors"], bundle_bytes, prepared)])


def _agrees(key: str, factors: dict):
    def check(entry: CachedEntry) -> None:
        try:
            bundle = json.loads(entry.record["bundle"])
        except ValueError:
            raise KilnError("its record's bundle is not JSON") from None
        if not isinstance(bundle, dict) or bundle.get("key") != key or bundle.get("factors") != factors:
            raise KilnError("its bundle's key or factors are not this build's")
        files = entry.layers[0].files
        listed = bundle.get("files")
        if not isinstance(listed, dict) or {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()} != listed:
            raise KilnError("its layer's files are not the ones its bundle lists (sha256 each)")
    return check


def cached_warm(prepared: PreparedBuild, cache_from, config: RegistryConfig, budget: Budget, cache: Path,
                reporter: Reporter = SILENT, open_record=plain_record) -> PreparedBuild:
    """``prepared`` with the ``warm`` entry of its own warm key (from its audit record) baked on top,
    from the first ``cache_from`` whose entry verifies; a ``KilnError`` when none does (the build
    asked for a warm image and publishes nothing)."""
    factors = key_factors(json.loads(prepared.layers[0].files[AUDIT_PATH]), prepared.inputs.definition,
                          prepared.inputs.platform)
    key = warm_key(factors)
    use = _use(key, factors)
    entry = CacheReader(cache_from, config, prepared.stats, budget, cache, reporter, open_record).read(
        use, _agrees(key, factors))
    if entry is None:  # asked for a warm image: a cold one under that name would be a silent step back
        raise KilnError(f"--warm-from-cache: no warm entry of this build's warm key {key} verifies in "
                        f"{', '.join(location.name for location in cache_from)}: nothing built (warm it once: "
                        "build.py warm, then build --warm DIR --cache-to; docs/WARM.md)")
    if not entry.signed:  # the layer is compiled code the image loads: say who could have written it
        reporter.warn(f"build cache: using unsigned warm entry from {entry.where}: whoever can push there can "
                      "change its compiled code undetected; --cache-key PUB takes signed entries only")
    text = entry.record["bundle"].encode("utf-8")
    warmed = bake_warm(prepared, bundle_summary(json.loads(text), text), entry.layers[0].files, entry.where)
    hit = _use(key, factors, text, warmed)
    hit.hit, hit.location = use.hit, use.location
    return replace(warmed, cache=[*warmed.cache, hit])
