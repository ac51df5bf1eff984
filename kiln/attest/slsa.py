"""The image's provenance: an in-toto Statement v1 with a SLSA Provenance v1 predicate.

Public API:
    STATEMENT_TYPE, PREDICATE_TYPE, BUILD_TYPE
    provenance_statement(image, sbom: bytes) -> bytes      canonical JSON (the DSSE payload)
    RecordedBuild                                          what ``check`` rebuilds from
    read_statement(payload, what) -> RecordedBuild

``buildDefinition.externalParameters`` holds what a rebuild needs and nothing a rebuild would
have to guess: the image definition (name, sha256 of its file), the pin (as locked), the SM,
the tag, and each selected patch module's digest. ``resolvedDependencies`` lists the base
manifest and layers, the patch modules and, for a kernel layer, the Triton toolchain wheel
(a ``pkg:pypi`` purl naming the wheel file, with its sha256).
``runDetails`` names the builder (kiln's repository), kiln's commit, the SBOM (as a byproduct,
by digest: a swapped SBOM does not match) and start/finish times from ``build_time`` (both the
same, reproducible instant: a build's wall clock would make the bytes differ every time).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kiln import __version__
from kiln.attest import Refused
from kiln.attest.sbom import SBOM_MEDIA_TYPE, build_time, triton_purl
from kiln.image.provenance import kiln_revision, kiln_source_url
from kiln.oci.mutate import canonical_json

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:kiln:build-type:image:v1"


def _hex(digest: str) -> dict:
    algorithm, _, value = digest.partition(":")
    return {algorithm: value}


def provenance_statement(image, sbom: bytes) -> bytes:
    """The in-toto statement whose subject is ``image``'s manifest digest."""
    prepared = image.prepared
    inputs = prepared.inputs
    catalogue = inputs.catalogue
    pin = inputs.pin
    commit, dirty = kiln_revision()
    when = build_time(image).strftime("%Y-%m-%dT%H:%M:%SZ")
    patches = {pid: catalogue.digests[pid] for pid in sorted(prepared.outcomes)}
    base_name = prepared.base_ref.name
    dependencies = [{"name": "base", "uri": f"oci://{base_name}@{prepared.base_digest}",
                     "digest": _hex(prepared.base_digest)}]
    dependencies += [{"name": f"base layer {i}", "uri": f"oci://{base_name}@{layer.digest}",
                      "digest": _hex(layer.digest), "mediaType": layer.media_type}
                     for i, layer in enumerate(prepared.base_model.layers)]
    for pid, digest in patches.items():
        patch = catalogue.get(pid)
        module = patch.source_file.rsplit("/", 1)[-1]
        dependencies.append({"name": f"patch {pid}", "uri": f"patchsets/{patch.family}/{module}",
                             "digest": {"sha256": digest}})
    triton = prepared.triton or {}
    if triton.get("triton_wheel"):
        # a purl, not the download URL: a mirror or a local index would make the bytes differ
        wheel = {"name": "triton toolchain", "uri": triton_purl(triton).to_string(),
                 "annotations": {"wheel": triton["triton_wheel"],
                                 "record_sha256": triton.get("toolchain_record_sha256")}}
        if triton.get("triton_wheel_sha256"):
            wheel["digest"] = {"sha256": triton["triton_wheel_sha256"]}
        dependencies.append(wheel)
    if prepared.warm:  # the bundle baked as the warm layer: its record's sha256 and key (kiln.warm)
        warm = prepared.warm
        dependencies.append({"name": "warm cache", "uri": f"kiln-warm:{warm['key']}",
                             "digest": {"sha256": warm["record_sha256"]},
                             "annotations": {"booted": " ".join(warm["booted"]["serve"]), "hardware": warm["hardware"],
                                             "versions": warm["versions"], "factors": warm["factors"]}})
    definition = inputs.definition
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"{definition.name}:{prepared.tag}", "digest": _hex(image.manifest.digest)}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "image": {"name": definition.name,
                              "sha256": hashlib.sha256(definition.path.read_bytes()).hexdigest()},
                    "pin": {"name": pin.name, "image": pin.image, "vllm": str(pin.vllm), "cuda": pin.cuda,
                            "digest": pin.digest, "role": pin.role},
                    "sm": inputs.sm,
                    "tag": prepared.tag,
                    "patches": patches,
                },
                "internalParameters": {"env": dict(sorted(prepared.env.items()))},
                "resolvedDependencies": dependencies,
            },
            "runDetails": {
                "builder": {"id": kiln_source_url() or "urn:kiln:builder",
                            "version": {"kiln": __version__, "commit": commit or "unknown",
                                        "dirty": str(dirty).lower()}},
                "metadata": {"invocationId": f"{definition.name}:{prepared.tag}@{image.manifest.digest}",
                             "startedOn": when, "finishedOn": when},
                "byproducts": [{"name": "sbom", "mediaType": SBOM_MEDIA_TYPE,
                                "digest": {"sha256": hashlib.sha256(sbom).hexdigest()}}],
            },
        },
    }
    return canonical_json(statement)


@dataclass(frozen=True)
class RecordedBuild:
    subject: str  # sha256:… of the image manifest the statement is about
    image: str
    definition_sha256: str
    pin: dict
    sm: int
    tag: str
    patches: dict[str, str]
    commit: str
    sbom_sha256: str
    warm: dict | None = None  # the ``warm cache`` dependency (kiln.image.warmlayer): the bundle's record sha256, key


def read_statement(payload: bytes, what: str) -> RecordedBuild:
    """The recorded inputs of a statement kiln wrote; a one-line error for anything else."""
    try:
        statement = json.loads(payload)
        if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
            raise Refused(f"{what}: not an in-toto SLSA v1 provenance statement")
        predicate = statement["predicate"]
        definition = predicate["buildDefinition"]
        if definition.get("buildType") != BUILD_TYPE:
            raise Refused(f"{what}: build type {definition.get('buildType')!r} is not kiln's ({BUILD_TYPE})")
        params = definition["externalParameters"]
        [subject] = statement["subject"]
        sbom = [b for b in predicate["runDetails"].get("byproducts", []) if b.get("name") == "sbom"]
        warm = [{"record_sha256": d["digest"]["sha256"], "key": d["uri"].removeprefix("kiln-warm:")}
                for d in definition.get("resolvedDependencies", []) if d.get("name") == "warm cache"]
        return RecordedBuild(
            subject="sha256:" + subject["digest"]["sha256"], image=params["image"]["name"],
            definition_sha256=params["image"]["sha256"], pin=dict(params["pin"]), sm=int(params["sm"]),
            tag=params["tag"], patches=dict(params["patches"]),
            commit=predicate["runDetails"]["builder"]["version"]["commit"],
            sbom_sha256=sbom[0]["digest"]["sha256"] if sbom else "", warm=warm[0] if warm else None)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise Refused(f"{what}: provenance statement is malformed ({type(err).__name__}: {err})") from None
