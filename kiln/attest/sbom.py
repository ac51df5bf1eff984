"""The image's SBOM: CycloneDX 1.6 JSON, built with ``cyclonedx-python-lib``, reproducible.

Public API:
    SBOM_MEDIA_TYPE                 "application/vnd.cyclonedx+json"
    build_time(image) -> datetime   ``SOURCE_DATE_EPOCH``, else the base config's ``created``, else 1970
    image_sbom(image) -> bytes      canonical JSON
    triton_purl(triton) -> PackageURL   the toolchain wheel's ``pkg:pypi`` purl (the provenance uses it too)

The SBOM describes the image by manifest digest and lists: the base (name, digest); vLLM (its
version, each applied patch as a ``pedigree`` patch resolving its upstream references); each
selected patch's module (sha256, verdict, upstream refs, the files it changed with their sha256
before and after); every file kiln's layers bake in (sha256); the Triton kernels (name, SM,
toolchain version, its wheel's file name and sha256 and the sha256 of the wheel's RECORD) and the
Triton toolchain wheel itself (a library component hashed with the wheel's sha256); the warm
layer's compile cache when there is one (its key, the versions and hardware it was made on, what
booted; its files are among the baked ones); kiln
(version, commit). It is derived only from the ``BuiltImage``: the serial number is a UUID5 of the manifest digest, the
timestamp is ``build_time``, so the same inputs give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import warnings
from datetime import UTC, datetime

from cyclonedx.model import HashAlgorithm, HashType, Property
from cyclonedx.model.bom import Bom, BomMetaData
from cyclonedx.model.component import Component, ComponentType, Patch, PatchClassification, Pedigree
from cyclonedx.model.issue import IssueClassification, IssueType
from cyclonedx.output.json import JsonV1Dot6
from packageurl import PackageURL

from kiln import __version__
from kiln.errors import KilnError
from kiln.image.provenance import kiln_revision
from kiln.oci.mutate import canonical_json
from kiln.patch.outcome import Verdict

SBOM_MEDIA_TYPE = "application/vnd.cyclonedx+json"
_KILN_NS = uuid.UUID("6b696c6e-0000-5000-8000-736266f6d000")  # fixed: serial numbers derive from digests


def build_time(image) -> datetime:
    """The time attestations record: reproducible, never the clock."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if epoch:
        try:
            return datetime.fromtimestamp(int(epoch), UTC)
        except (ValueError, OverflowError):
            raise KilnError(f"SOURCE_DATE_EPOCH={epoch!r}: not a whole number of seconds") from None
    created = image.prepared.base_model.config.get("created")
    if isinstance(created, str) and created:
        try:
            return datetime.fromisoformat(created.replace("Z", "+00:00")).astimezone(UTC).replace(microsecond=0)
        except ValueError:
            pass
    return datetime.fromtimestamp(0, UTC)


def _sha256(hexdigest: str | None) -> list[HashType]:
    return [HashType(alg=HashAlgorithm.SHA_256, content=hexdigest)] if hexdigest else []


def _props(**values) -> list[Property]:
    return [Property(name=f"kiln:{k}", value=str(v)) for k, v in sorted(values.items()) if v not in (None, "")]


def _patch_components(image) -> tuple[list[Component], list[Patch]]:
    prepared = image.prepared
    catalogue = prepared.inputs.catalogue
    site = prepared.site_dir
    components, pedigree = [], []
    for pid, outcome in sorted(prepared.outcomes.items()):
        patch = catalogue.get(pid)
        files = []
        for rel, (before, after) in sorted((outcome.files or {}).items()):
            files.append(Component(type=ComponentType.FILE, name=f"/{site}/vllm/{rel}",
                                   bom_ref=f"patch:{pid}:file:{rel}", hashes=_sha256(after),
                                   properties=_props(before_sha256=before or "absent", after_sha256=after)))
        refs = ",".join(patch.upstream_refs)
        components.append(Component(
            type=ComponentType.FILE, name=f"patch {pid}", bom_ref=f"patch:{pid}", description=patch.title,
            hashes=_sha256(catalogue.digests[pid]), components=files,
            properties=_props(verdict=str(outcome.verdict), family=patch.family, upstream_refs=refs,
                              module=os.path.basename(patch.source_file))))
        if outcome.verdict is Verdict.APPLIES:
            pedigree.append(Patch(type=PatchClassification.BACKPORT if refs else PatchClassification.UNOFFICIAL,
                                  resolves=[IssueType(type=IssueClassification.DEFECT, id=ref, name=ref)
                                            for ref in patch.upstream_refs]))
    return components, pedigree


def _baked_files(image) -> list[Component]:
    out = []
    for index, contents in enumerate(image.prepared.layers):
        layer = image.layers[index]
        for path, data in sorted(contents.files.items()):
            out.append(Component(type=ComponentType.FILE, name=f"/{path}", bom_ref=f"layer:{index}:{path}",
                                 hashes=_sha256(hashlib.sha256(data).hexdigest()),
                                 properties=_props(layer=layer.digest)))
    return out


def _kernels(image) -> list[Component]:
    triton = image.prepared.triton or {}
    kernels = [Component(type=ComponentType.FILE, name=f"triton kernel {name}", bom_ref=f"kernel:{name}",
                         properties=_props(sm=triton.get("sm"), triton=triton.get("triton"),
                                           triton_wheel=triton.get("triton_wheel"),
                                           triton_wheel_sha256=triton.get("triton_wheel_sha256"),
                                           triton_record_sha256=triton.get("toolchain_record_sha256")))
               for name in triton.get("kernel_names", [])]
    if not triton.get("triton_wheel"):
        return kernels
    toolchain = Component(type=ComponentType.LIBRARY, name="triton", bom_ref="triton-toolchain",
                          version=triton.get("triton"), purl=triton_purl(triton),
                          hashes=_sha256(triton.get("triton_wheel_sha256")),
                          properties=_props(wheel=triton["triton_wheel"], role="kernel compiler",
                                            record_sha256=triton.get("toolchain_record_sha256")))
    return [toolchain, *kernels]


def _warm(image) -> list[Component]:
    """The warm layer's compile cache (its files are listed with the layers'): what booted, on what, keyed by what."""
    warm = image.prepared.warm or {}
    if not warm:
        return []
    versions, hardware, booted = warm.get("versions") or {}, warm.get("hardware") or {}, warm.get("booted") or {}
    return [Component(type=ComponentType.DATA, name="vllm compile cache", bom_ref="warm", version=warm.get("key"),
                      hashes=_sha256(warm.get("record_sha256")),
                      properties=_props(warm_key=warm.get("key"), files=warm.get("files"), bytes=warm.get("bytes"),
                                        torch=versions.get("torch"), triton=versions.get("triton"),
                                        machine=hardware.get("machine"), processor=hardware.get("processor"),
                                        platform=hardware.get("platform"), sm=hardware.get("sm"),
                                        booted=" ".join(booted.get("serve") or []),
                                        vllm_cache_dirs=",".join(warm.get("vllm_cache_dirs") or [])))]


def triton_purl(triton: dict) -> PackageURL:
    """``pkg:pypi/triton@3.6.0?file_name=<wheel>``: the wheel on PyPI, whatever index served it."""
    return PackageURL(type="pypi", name="triton", version=triton.get("triton"),
                      qualifiers={"file_name": triton["triton_wheel"]})


def image_sbom(image) -> bytes:
    """The CycloneDX 1.6 SBOM of ``image`` (a ``BuiltImage``), canonical JSON."""
    prepared = image.prepared
    digest = image.manifest.digest
    commit, dirty = kiln_revision()
    patches, pedigree = _patch_components(image)
    base = Component(type=ComponentType.CONTAINER, name=str(prepared.base_ref), bom_ref="base",
                     version=prepared.base_digest, hashes=_sha256(prepared.base_digest.split(":", 1)[1]))
    vllm = Component(type=ComponentType.FRAMEWORK, name="vllm", bom_ref="vllm",
                     version=prepared.vllm_version,
                     pedigree=Pedigree(patches=pedigree) if pedigree else None,
                     properties=_props(site_dir=f"/{prepared.site_dir}"))
    kiln = Component(type=ComponentType.APPLICATION, name="kiln", bom_ref="kiln", version=__version__,
                     properties=_props(commit=commit, dirty=str(dirty).lower()))
    subject = Component(type=ComponentType.CONTAINER, name=prepared.inputs.definition.name, bom_ref="image",
                        version=prepared.tag, hashes=_sha256(digest.split(":", 1)[1]),
                        properties=_props(manifest_digest=digest, pin=prepared.inputs.pin.name,
                                          sm=prepared.inputs.sm))
    others = [base, vllm, kiln, *patches, *_baked_files(image), *_kernels(image), *_warm(image)]
    bom = Bom(serial_number=uuid.uuid5(_KILN_NS, digest), version=1, components=others,
              metadata=BomMetaData(timestamp=build_time(image), component=subject))
    bom.register_dependency(subject, others)
    with warnings.catch_warnings():  # the library warns through ``warnings``; kiln's library code stays silent
        warnings.simplefilter("ignore")
        text = JsonV1Dot6(bom).output_as_string()
    return canonical_json(json.loads(text))
