"""The registry build cache's keys: what each entry depends on (``kiln.image.regcache``).

Public API:
    PATCHED, KERNELS, CATALOGUE, WARM   the entry kinds; ARTIFACT_TYPES: kind -> artifactType
    entry_tag(kind, key) -> str      ``kiln-cache-<kind>-v2-<key>`` (patched: ``-v3-``; the toolchain's: ``-v1-``)
    canonical(value) -> bytes        the JSON a key hashes and a record is written as
    vllm_layers(layers, count, to_bottom=False) -> dict   the top ``count`` layers, as the walk reads them
    walk_read(layers, layers_read) -> dict                 the same, of a walk that has read ``layers_read``
    probe_walks(layers, depth) -> list[dict]               what a hit may have been keyed by, shallowest first
    patched_key(inputs, walk, need_triton) -> (hex key, the inputs it hashes)   probed before any layer is read
    source_identity(tree, site_dir, vllm_files, targets) -> dict   what the patching reads of a base
    source_key(inputs, source) -> (hex key, inputs)  the same entry by its pristine files: shared across platforms
    kernels_key(inputs, layers_read, base_env, leave_out_unusable_kernels=False) -> (hex key, inputs)
    catalogue_key(patchsets) -> (hex key, inputs)

A build is a pure function of its inputs, so each part of it is keyed by sha256 of canonical
JSON of exactly the inputs that part depends on (with kiln's version and a hash of all its
modules and schemas, and Python's ``major.minor``), and builds sharing those inputs share it.

What a build takes from the base's layers, it takes through the layer walk
(``kiln.source.image.read_vllm``, ``kiln.source.layerwalk``): from the top-most layer down, it
reads until its stop rule says no lower layer can change what it found (vLLM's tree, site
dir and files, and with ``need_triton`` Triton's dist-info), or the layers run out. The walk
reads nothing else, so it is deterministic in the layers it read: a base whose top-most ``k``
layers are the same blobs, read the same way (gzip or plain tar), as those of a base on which
the walk stopped after ``k`` gives the same result, whatever lies below (a rebuilt CUDA layer,
a filler). Those ``k`` layers (``vllm_layers``) key the entries, not the base's digest (a
superset: any change of a lower layer missed). A walk that ran out of layers (``to_bottom``)
held only for a base of exactly those layers: it is keyed apart. A base's other input, its
config, is read in whole (Env is keyed where it counts); its manifest and labels are each
build's own.

* ``patched``: the vLLM layers read (and ``need_triton``: reading on for Triton may see a
  stray lower file), the pin's vLLM version, the definition's patch list and every selected
  patch module's sha256, and what the build target decides of each patch (out of range,
  gated: the only use the engine makes of the SM and the model preset). No image name, tag,
  SM or baked file: each build assembles its image's patched-source layer (baked files, audit
  file) from the entry, so images on one base and selection share it, whatever their SMs.
  It names the build's platform (``linux/arm64``): an index's platforms may share their vLLM
  layers' blobs, and the key is what a build probes for before it reads any of them.
* ``patched`` by source (``source_key``): the same entry written again under the key of what the
  patching depends on, the pristine files and the patch modules: the vLLM version, the
  selection, the target's decisions, and ``source_identity`` (the site dir, every ``.py`` file
  of vLLM by sha256, the bytecode files the whiteouts are made for, each targeted file's
  sha256). No layer digest and no platform: vLLM's x86_64 and aarch64 wheels carry
  byte-identical ``.py`` files (``tests/source/test_platform_wheels.py``), so every platform of
  a pin, and every SM, shares it. It is known only once the walk has read the layers: a build
  whose probe missed reads its base, then asks for it before it patches. (The key changed with
  this: entries written before are not found.)

* ``kernels``: one SM's kernel layer. The vLLM layers read (they hold Triton's dist-info, hence
  its version and RECORD, the toolchain wheel and the image's Python, and the pristine kernel
  sources), the base config's Env and the definition's serve env (the compile's environment),
  the SM, the kernel preset, ``--without-unusable-kernels``, and the kernel sources' patching:
  "pristine" when no selected patch touches a file the kernels are compiled from, else the
  selection as the ``patched`` key has it. A change of selection that touches no kernel
  source keeps it.
* ``catalogue``: the catalogue's facts (``kiln.patch.facts``), keyed by the bytes of every file
  under ``patchsets/`` (with kiln's code, as every key): a build whose other entries all hit
  reads them instead of importing the patch modules.

The ``patched`` key needs the layers read before any is read (a hit reads no vLLM layer), and
which they are is known only by reading them; so a build with ``--cache-from`` probes
(``probe_walks``, ``kiln.image.cachelookup``): the key of the top 1, 2, … ``depth`` layers,
and of all of them read to the bottom; a hit's key names exactly the layers its walk read, so
at most one depth can hold a right entry for a base. The ``kernels`` key is known once the
layers read are: from the walk, or from the ``patched`` hit's key (the walk with
``need_triton`` reads down to Triton, so the same layers hold it).
"""

from __future__ import annotations

import hashlib
import json
import sys
from functools import cache
from pathlib import Path

import kiln
from kiln import __version__
from kiln.errors import KilnError
from kiln.image.inputs import BuildInputs
from kiln.oci.manifest import Descriptor
from kiln.oci.mediatypes import tar_mode
from kiln.patch.facts import source_files
from kiln.triton.aot import reads_source

PATCHED, KERNELS, CATALOGUE, WARM = "patched", "kernels", "catalogue", "warm"
ARTIFACT_TYPES = {PATCHED: "application/vnd.kiln.cache.patched.v1",
                  KERNELS: "application/vnd.kiln.cache.kernels.v1",
                  CATALOGUE: "application/vnd.kiln.cache.catalogue.v1",
                  WARM: "application/vnd.kiln.cache.warm.v1"}  # keyed by the warm key: ``kiln.image.warmcache``


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
    key_inputs = json.loads(canonical({"kind": kind, "format": ARTIFACT_TYPES[kind],
                                        "kiln": {"version": __version__, "code": _kiln_code()},
                                        "python": f"{sys.version_info[0]}.{sys.version_info[1]}", **key_inputs}))
    return hashlib.sha256(canonical(key_inputs)).hexdigest(), key_inputs  # as read back: lists, not tuples


def vllm_layers(layers: list[Descriptor], count: int, to_bottom: bool = False) -> dict:
    """What the layer walk (``kiln.source.image.read_vllm``) reads: the base's top-most ``count``
    layers (``layers`` as its manifest lists them, bottom first), top-most first, each by digest
    and how it is read (``tar_mode``: Docker's and OCI's gzip layer types read alike).
    ``to_bottom``: they are all the base's layers and the walk read down to the last without its
    stop rule saying so (what it found then holds only for a base of exactly these layers)."""
    top = layers[::-1][:count]
    return {"layers": [{"digest": d.digest, "read_as": tar_mode(d.media_type)} for d in top],
            "to_bottom": to_bottom}


def walk_read(layers: list[Descriptor], layers_read) -> dict:
    """``vllm_layers`` of a walk that read ``layers_read`` (digests, top-most first) of ``layers``."""
    walk = vllm_layers(layers, len(layers_read), len(layers_read) == len(layers))
    if [layer["digest"] for layer in walk["layers"]] != list(layers_read):
        raise KilnError(f"the vLLM layers read ({', '.join(layers_read)}) are not the base's top-most layers")
    return walk


def probe_walks(layers: list[Descriptor], depth: int) -> list[dict]:
    """The ``vllm_layers`` a hit may have been written for, shallowest first: the top 1..``depth``
    layers, the whole base as read to its bottom, and none from a layer the walk cannot read on."""
    walks = []
    for count in range(1, min(len(layers), depth) + 1):
        try:
            walks.append(vllm_layers(layers, count))
        except KilnError:  # a layer no walk reads: no entry was written at or below it
            return walks
    if len(layers) <= depth and walks:
        walks.append({**walks[-1], "to_bottom": True})
    return walks


def _selection(inputs: BuildInputs) -> dict:
    """The patching's inputs besides the source: the selection and what the target decides of each patch."""
    definition, catalogue, target = inputs.definition, inputs.catalogue, inputs.target()
    patches = []
    for pid in catalogue.closure(list(definition.patches)):
        patch = catalogue.get(pid)
        patches.append({"id": pid, "sha256": catalogue.digests[pid],
                        "out_of_range": patch.outside_range(target.vllm_version) or None,
                        "gated": patch.gates.blocks(target) or None})
    return {"vllm": str(inputs.pin.vllm), "selection": list(definition.patches), "patches": patches}


def patched_key(inputs: BuildInputs, walk: dict, need_triton: bool) -> tuple[str, dict]:
    """The patched entry's key: the vLLM layers the walk reads (``vllm_layers``; ``need_triton``
    reads on for Triton, which may read a stray file of a lower layer), the selection and what
    the target decides of each patch."""
    return _keyed(PATCHED, {"vllm_layers": walk, "need_triton": need_triton, "platform": inputs.platform,
                            **_selection(inputs)})


def source_identity(tree, site_dir: str, vllm_files, targets) -> dict:
    """What the patching reads of a base and what its layer is made for: the site dir, a digest of
    every ``.py`` file of vLLM the walk saw (``vllm_files``, vllm-relative; path and sha256: a
    patch may read any module), a digest of the
    bytecode names the whiteouts are made for, and each of ``targets`` (vllm-relative) by
    sha256 (None: absent), which a hit's recorded pristine hashes are checked against."""
    python = hashlib.sha256()
    for rel in sorted(f for f in vllm_files if f.endswith(".py")):  # the walk's list: no directory scan
        python.update(f"{rel}\0{_file_sha256(tree, rel)}\n".encode())
    bytecode = hashlib.sha256("\n".join(sorted(f for f in vllm_files if f.endswith(".pyc"))).encode())
    files = {rel: _file_sha256(tree, rel) for rel in sorted(targets)}
    return {"site_dir": site_dir, "python": python.hexdigest(), "bytecode": bytecode.hexdigest(), "files": files}


def _file_sha256(tree, rel: str) -> str | None:
    return hashlib.sha256(tree.file(rel).read_bytes()).hexdigest() if tree.exists(rel) else None


def source_key(inputs: BuildInputs, source: dict) -> tuple[str, dict]:
    """The patched entry's key by what it depends on (``source_identity``, the selection, the
    target's decisions): no layer, no platform, no SM."""
    return _keyed(PATCHED, {"source": source, **_selection(inputs)})


def kernels_key(inputs: BuildInputs, layers_read: list[dict], base_env: dict[str, str],
                leave_out_unusable_kernels: bool = False) -> tuple[str, dict]:
    """One SM's kernel entry's key. ``layers_read``: the walk's (``vllm_layers(...)["layers"]``) of
    a base whose walk reads exactly them (known: it walked, or its patched entry hit); ``base_env``:
    the base config's Env (the compile's environment)."""
    definition, catalogue = inputs.definition, inputs.catalogue
    kernels = definition.model.kernels
    touched = any(reads_source(kernels, rel) for pid in catalogue.closure(list(definition.patches))
                  for rel in catalogue.get(pid).targets)
    return _keyed(KERNELS, {"vllm_layers": layers_read, "base_env": dict(base_env), "sm": inputs.sm,
                            "platform": inputs.platform,  # its Triton: that machine's wheel
                            "preset": kernels.to_json(), "serve_env": dict(definition.serve_env),
                            "leave_out_unusable_kernels": leave_out_unusable_kernels,
                            "sources": _selection(inputs) if touched else "pristine"})


def catalogue_key(patchsets: Path) -> tuple[str, dict]:
    """The catalogue entry's key: every file under ``patchsets`` by sha256 (``source_files``)."""
    return _keyed(CATALOGUE, {"patchsets": source_files(patchsets)})


_TAG_VERSIONS = {PATCHED: "v3", KERNELS: "v2"}  # v2: keyed by the vLLM layers; v3: a patched record names its source


def entry_tag(kind: str, key: str) -> str:
    return f"kiln-cache-{kind}-{_TAG_VERSIONS.get(kind, 'v1')}-{key}"


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
