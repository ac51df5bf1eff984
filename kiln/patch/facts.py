"""The catalogue's facts without its code: what a build takes from each patch module short of
running its codemods, as data a registry build cache carries (``kiln.image.regcache``).

Public API:
    FIELDS                                   what is kept of each patch
    PatchFacts                               one patch's facts: the attributes a ``Patch`` has for them
    catalogue_facts(catalogue) -> dict       ``{"patches": {id: {...}}, "digests": {id: sha256}}``
    facts_catalogue(root, facts, where) -> Catalogue   a catalogue of ``PatchFacts``; KilnError when malformed
    source_files(root) -> dict               every file under ``patchsets/``: relative path -> sha256

A build served whole from a registry cache needs, of the catalogue, the selection's closure
and each module's sha256 (the keys), requires, conflicts and gates (the definition's checks),
version ranges and gates (what the target decides), targets (the kernels' key) and titles,
families, modules and upstream references (the SBOM and the provenance). Loading the catalogue
imports every patch module, hence libcst (0.3 s of a 1 s cache hit). So a build with
``--cache-to`` also writes these facts as an entry keyed by the raw bytes of every file under
``patchsets/`` (``source_files``) and kiln's own code (``kiln.image.cachekeys``), and a build
with ``--cache-from`` reads them before it loads anything: the same bytes give the same facts,
so a ``Catalogue`` of ``PatchFacts`` answers as the real one would. Where anything must be
patched after all (a miss), the build loads the real catalogue and checks the facts it used
against it (``kiln.image.prepare``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from kiln.errors import KilnError
from kiln.patch.catalog import Catalogue
from kiln.patch.outcome import Gates, outside_written_range

FIELDS = ("family", "title", "upstream_refs", "requires", "conflicts", "gates", "written_for", "variant",
          "targets", "module")
_TUPLES = ("upstream_refs", "requires", "conflicts", "targets")
_GATE_TUPLES = ("kv_cache_dtypes", "architectures")


@dataclass(frozen=True)
class PatchFacts:
    """What a ``Patch`` says of itself, read from a cache entry: the same attribute names."""

    id: str
    family: str
    title: str
    upstream_refs: tuple[str, ...]
    requires: tuple[str, ...]
    conflicts: tuple[str, ...]
    gates: Gates
    written_for: str
    variant: bool
    targets: tuple[str, ...]
    source_file: str  # under the catalogue's root, as the loader sets it

    def outside_range(self, version: Version) -> str | None:
        return outside_written_range(self.written_for, version)


def catalogue_facts(catalogue: Catalogue) -> dict:
    """The facts of every patch of ``catalogue`` (real, or itself made of facts), as JSON data."""
    patches = {}
    for pid, patch in catalogue.patches.items():
        patches[pid] = {
            "family": patch.family, "title": patch.title, "upstream_refs": list(patch.upstream_refs),
            "requires": list(patch.requires), "conflicts": list(patch.conflicts),
            "gates": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(patch.gates).items()},
            "written_for": patch.written_for, "variant": patch.variant, "targets": list(patch.targets),
            "module": Path(patch.source_file).relative_to(catalogue.root).as_posix(),
        }
    return {"patches": patches, "digests": dict(catalogue.digests)}


def facts_catalogue(root: Path, facts: dict, where: str) -> Catalogue:
    """A ``Catalogue`` of ``PatchFacts`` under ``root``; KilnError (naming ``where``) when ``facts``
    is not what ``catalogue_facts`` writes."""
    def fail(why: str) -> KilnError:
        return KilnError(f"{where}: {why}")

    patches, digests = facts.get("patches"), facts.get("digests")
    if not isinstance(patches, dict) or not isinstance(digests, dict) or set(patches) != set(digests):
        raise fail("its patches and digests do not name the same patches")
    found = {}
    for pid, data in patches.items():
        if not isinstance(data, dict) or set(data) != set(FIELDS) or not isinstance(digests[pid], str):
            raise fail(f"patch {pid!r}: not the fields {', '.join(FIELDS)}")
        gates = data["gates"]
        field_names = {f.name for f in dataclasses.fields(Gates)}
        if not isinstance(gates, dict) or set(gates) != field_names:
            raise fail(f"patch {pid!r}: gates are not {', '.join(sorted(field_names))}")
        strings = [data[name] for name in ("family", "title", "written_for", "module")]
        lists = [data[name] for name in _TUPLES] + [gates[name] for name in _GATE_TUPLES]
        if not all(isinstance(v, str) for v in strings) or not isinstance(data["variant"], bool) \
                or not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in lists):
            raise fail(f"patch {pid!r}: a field of the wrong type")
        module = root / data["module"]
        if Path(data["module"]).is_absolute() or ".." in Path(data["module"]).parts:
            raise fail(f"patch {pid!r}: module {data['module']!r} is not under the catalogue")
        found[pid] = PatchFacts(
            id=pid, family=data["family"], title=data["title"],
            **{name: tuple(data[name]) for name in _TUPLES},
            gates=Gates(**{k: tuple(v) if k in _GATE_TUPLES else v for k, v in gates.items()}),
            written_for=data["written_for"], variant=data["variant"], source_file=str(module))
    for patch in found.values():
        if not set(patch.requires) <= set(found):
            raise fail(f"patch {patch.id!r} requires a patch it does not list")
    catalogue = Catalogue(root, found, dict(digests))
    try:
        catalogue.order(found)  # a requires cycle: refused as the loader refuses it
    except KilnError as err:
        raise fail(str(err)) from None
    return catalogue


def source_files(root: Path) -> dict[str, str]:
    """Every file under ``root`` (``patchsets/``) but bytecode: relative path -> sha256 of its bytes.

    The catalogue's facts are a function of these bytes and kiln's code: a module, a content file
    a ``NewFile`` adds, or any other file changed, added or removed gives other facts' key."""
    if not root.is_dir():
        raise KilnError(f"{root}: patchsets directory not found")
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
            out[rel.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
