"""``check``: a pulled image's attestations verified, then the image re-derived bit for bit.

Public API:
    CheckResult        reference, digest, tag (the recorded one), platform, signed_by (keyid or None),
                       identical, difference
    check_image(reference, files, config, public_key=None, reporter=SILENT, allow_moved_tag=False)
        -> CheckResult

An index (one tag's platforms) is checked platform by platform, each as below on its own
platform of the base; the first that fails or differs is named (``linux/arm64 (sha256:…): …``);
then the index must hold the platforms the definition ships the SM on, and re-made from the
re-derived manifests be the index the reference names.

In order, each failure a one-line ``KilnError``: the reference resolves to an image manifest
(built on the platform its config names);
its referrers (the referrers API, else the ``sha256-<hex>`` tag) hold a provenance and an SBOM
whose artifact ``subject`` is this digest; with a key, a provenance signature verifies; the
statement's subject is this digest; a tag in the reference is the tag the provenance records
(a tag moved onto another signed image is refused, naming both tags, unless
``allow_moved_tag``: then a warning); the SBOM is the one the provenance records; the local
image definition, patch modules and kiln commit are the recorded ones. Then the image is
rebuilt from the recorded pin (its locked base digest), SM and definition in a temporary
cache (sharing only the user's Triton toolchains), and compared: the same manifest digest (and the same SBOM and statement bytes) is
``identical``. An image with a warm layer (its provenance records a ``warm cache``) is re-derived
with the image's own warm layer baked on top (``kiln.attest.warmcheck``): compile output is not
bit-reproducible, so that one layer is verified by the digest the provenance fixes, not re-made
(``CheckResult.warm``). Otherwise the difference names the first differing annotation, layer and file,
or config field (``kiln.attest.treediff``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import Version

from kiln.attest import Refused
from kiln.attest.dsse import keyid_of, open_envelope, verify_envelope
from kiln.attest.referrers import (
    DSSE_MEDIA_TYPE,
    SBOM_MEDIA_TYPE,
    attestations,
    index_entries,
    referrers_tag,
)
from kiln.attest.slsa import RecordedBuild, read_statement
from kiln.attest.treediff import describe_difference
from kiln.attest.warmcheck import rewarm
from kiln.cache import cache_root
from kiln.definitions import image_path, load_definition
from kiln.errors import KilnError
from kiln.image.image import BuiltIndex, bake
from kiln.image.inputs import BuildInputs
from kiln.image.prepare import prepare_build
from kiln.image.provenance import kiln_revision
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.manifest import Manifest
from kiln.oci.reference import parse_reference
from kiln.oci.registry import RegistryClient
from kiln.patch.catalog import load_catalogue
from kiln.paths import RepoFiles
from kiln.pins import Pin, load_pins
from kiln.report import SILENT, Reporter
from kiln.triton.toolchain import toolchains_dir

_ATTESTATION_MAX = 16 << 20  # an SBOM or envelope larger than this is not one kiln wrote


@dataclass
class CheckResult:
    reference: str
    digest: str
    signed_by: str | None
    identical: bool
    difference: str = ""
    tag: str = ""  # the tag the provenance records
    platform: str = ""  # "linux/amd64 sm_120": the image config's os/architecture (an index: each) and the SM
    sm: int = 0  # the recorded SM
    warm: str = ""  # the warm layer's digest: verified by the recorded digest (and signature), not re-derived


def _attached(client: RegistryClient, repo: str, digest: str) -> dict[str, list[tuple[Manifest, bytes]]]:
    """artifact type -> [(artifact manifest, its document)] of the artifacts naming ``digest``."""
    index = client.referrers(repo, digest) or client.find_manifest(repo, referrers_tag(digest))
    found: dict[str, list[tuple[Manifest, bytes]]] = {}
    for entry in index_entries(index):
        if entry.get("artifactType") not in (SBOM_MEDIA_TYPE, DSSE_MEDIA_TYPE):
            continue
        artifact = client.get_manifest(repo, entry["digest"])
        subject = (artifact.json.get("subject") or {}).get("digest")
        if subject != digest:
            raise Refused(f"{repo}@{digest}: attached artifact {artifact.digest} names subject {subject}, "
                            "not this image")
        [layer] = artifact.layers
        if layer.size > _ATTESTATION_MAX:
            raise Refused(f"{repo}@{artifact.digest}: attestation of {layer.size} bytes is too large")
        with client.open_blob(repo, layer.digest, layer.size) as reader:
            document = reader.read()
        found.setdefault(artifact.json.get("artifactType"), []).append((artifact, document))
    return found


def _provenance(envelopes: list[tuple[Manifest, bytes]], public_key, what: str) -> tuple[bytes, str | None]:
    """The statement of the (last) provenance; with a key, of one whose signature verifies."""
    if public_key is None:
        _, payload, _ = open_envelope(envelopes[-1][1], f"{what} provenance {envelopes[-1][0].digest}")
        return payload, None
    failure = None
    for _artifact, document in reversed(envelopes):
        try:
            return verify_envelope(document, public_key, f"{what} provenance"), keyid_of(public_key)
        except KilnError as err:
            failure = err
    raise failure


def _local_inputs(files: RepoFiles, recorded: RecordedBuild, platform: str) -> BuildInputs:
    """The build inputs the provenance records, from this checkout; refused where they differ."""
    catalogue = load_catalogue(files.patchsets)
    path = image_path(files.images, recorded.image)
    if not path.is_file():
        raise Refused(f"{path}: the recorded image definition {recorded.image!r} is not in this checkout")
    local = hashlib.sha256(path.read_bytes()).hexdigest()
    if local != recorded.definition_sha256:
        raise Refused(f"{path}: differs from the recorded definition (sha256 {recorded.definition_sha256[:16]}… "
                        f"recorded, {local[:16]}… here)")
    for pid, digest in sorted(recorded.patches.items()):
        here = catalogue.digests.get(pid)
        if here != digest:
            where = catalogue.get(pid).source_file if here else f"{files.patchsets}"
            raise Refused(f"patch {pid}: {where} differs from the recorded module (sha256 {digest[:16]}… "
                            f"recorded, {(here or 'absent')[:16]}… here)")
    commit, _ = kiln_revision()
    if recorded.commit not in ("unknown", commit):
        raise Refused(f"built by kiln commit {recorded.commit}; this checkout is {commit}: check that "
                        "commit out to re-derive the image")
    raw = recorded.pin
    pin = Pin(raw["name"], raw.get("role", "current"), raw["image"], Version(raw["vllm"]), raw["cuda"], raw["digest"])
    pins = load_pins(files.pins) if files.pins.is_file() else {}
    definition = load_definition(files.images, recorded.image, catalogue, {**pins, pin.name: pin})
    shipped = definition.platforms_of(recorded.sm)
    if platform not in shipped:
        raise Refused(f"{path}: ships sm_{recorded.sm} on {', '.join(shipped)}, not on {platform} (the image's)")
    inputs = BuildInputs(files, definition, pin, recorded.sm, catalogue, platform=platform)
    if inputs.tag != recorded.tag:
        raise Refused(f"{path}: gives tag {inputs.tag}, the provenance records {recorded.tag}")
    return inputs


def _share_toolchains(cache: Path) -> None:
    """Triton toolchains (a wheel from PyPI each, checked when installed) are not what a rebuild
    re-derives: the temporary cache reuses the user's, rather than fetch ~190 MB again."""
    if os.environ.get("KILN_TRITON_TOOLCHAINS"):
        return
    mine = toolchains_dir(cache_root())
    if mine.is_dir():
        (cache / "triton").mkdir()
        (cache / "triton" / "toolchains").symlink_to(mine, target_is_directory=True)


def check_image(reference: str, files: RepoFiles, config: RegistryConfig, public_key=None,
                reporter: Reporter = SILENT, allow_moved_tag: bool = False) -> CheckResult:
    ref = parse_reference(reference)
    client = RegistryClient.for_registry(ref.registry, config)
    repo = ref.repository
    digest = ref.digest or client.resolve(repo, ref.ref)
    manifest = client.get_manifest(repo, digest)
    if manifest.is_index:
        return _check_index(reference, ref, client, config, manifest, files, public_key, reporter, allow_moved_tag)
    if manifest.config.size > _ATTESTATION_MAX:
        raise Refused(f"{ref.name}@{digest}: image config of {manifest.config.size} bytes is too large")
    with client.open_blob(repo, manifest.config.digest, manifest.config.size) as reader:
        built = json.loads(reader.read())
    platform = f"{built.get('os', '?')}/{built.get('architecture', '?')}"
    result, _ = _check_one(reference, ref, client, config, manifest, platform, files, public_key, reporter,
                           allow_moved_tag)
    return result


def _check_index(reference: str, ref, client: RegistryClient, config: RegistryConfig, index: Manifest,
                 files: RepoFiles, public_key, reporter: Reporter, allow_moved_tag: bool) -> CheckResult:
    """Every platform of the index re-derived in turn, the first that differs named; then the
    index itself, re-made from the re-derived manifests, must be the one the tag names."""
    repo, what = ref.repository, f"{ref.name}@{index.digest}"
    platforms = {}
    for entry in index.manifests:
        where = entry.platform or {}
        platform = f"{where.get('os', '?')}/{where.get('architecture', '?')}"
        if platform in platforms:
            raise Refused(f"{what}: lists {platform} twice")
        platforms[platform] = entry
    if not platforms:
        raise Refused(f"{what}: an index of no platforms")
    results, images = [], []
    for platform, entry in platforms.items():
        try:
            manifest = client.get_manifest(repo, entry.digest)
            if manifest.is_index:
                raise Refused(f"{ref.name}@{entry.digest}: an index inside the index")
            result, image = _check_one(reference, ref, client, config, manifest, platform, files, public_key,
                                       reporter, allow_moved_tag)
        except KilnError as err:
            raise Refused(f"{platform}: {err}") from None
        if not result.identical:
            return replace(result, reference=reference, digest=index.digest,
                           difference=f"{platform} ({entry.digest}): {result.difference}")
        results.append(result)
        images.append(image)
    shipped = images[0].prepared.inputs.definition.platforms_of(images[0].prepared.inputs.sm)
    named = ", ".join(platforms)
    if sorted(shipped) != sorted(platforms):
        return replace(results[0], reference=reference, digest=index.digest, identical=False,
                       difference=f"the index holds {named}; sm_{results[0].sm} ships on {', '.join(shipped)}")
    again = BuiltIndex(sorted(images, key=lambda image: shipped.index(image.prepared.inputs.platform))).manifest
    first = results[0]
    summary = f"{named} sm_{first.sm}"
    if again.digest != index.digest:
        return CheckResult(reference, index.digest, first.signed_by, False,
                           f"every platform is identical, but the index is not the re-derived one ({again.digest})",
                           first.tag, summary)
    return CheckResult(reference, index.digest, first.signed_by, True, tag=first.tag, platform=summary)


def _check_one(reference: str, ref, client: RegistryClient, config: RegistryConfig, manifest: Manifest,
               platform: str, files: RepoFiles, public_key, reporter: Reporter,
               allow_moved_tag: bool) -> tuple[CheckResult, object]:
    """One platform's image: its attestations verified, then re-derived on ``platform`` of the base."""
    repo, digest = ref.repository, manifest.digest
    what = f"{ref.name}@{digest}"
    found = _attached(client, repo, digest)
    if not found.get(DSSE_MEDIA_TYPE):
        raise Refused(f"{what}: no provenance attached (no referrer of type {DSSE_MEDIA_TYPE})")
    payload, signed_by = _provenance(found[DSSE_MEDIA_TYPE], public_key, what)
    if public_key is None:
        reporter.warn(f"{what}: provenance signature not verified (no --key given)")
    recorded = read_statement(payload, f"{what} provenance")
    if recorded.subject != digest:
        raise Refused(f"{what}: the provenance is for {recorded.subject}, not this image")
    if ref.tag and ref.tag != recorded.tag:
        moved = (f"{ref.name}:{ref.tag} names {digest}, whose provenance records the tag {recorded.tag}, "
                 f"not {ref.tag}")
        if not allow_moved_tag:
            raise Refused(f"{moved}: the tag was moved (check {ref.name}@{digest} to check that image, "
                          "or pass --allow-moved-tag)")
        reporter.warn(f"{moved} (--allow-moved-tag: checking it as {recorded.tag})")
    sboms = [doc for _, doc in found.get(SBOM_MEDIA_TYPE, [])]
    if not sboms:
        raise Refused(f"{what}: no SBOM attached (no referrer of type {SBOM_MEDIA_TYPE})")
    sbom = next((doc for doc in sboms if hashlib.sha256(doc).hexdigest() == recorded.sbom_sha256), None)
    if sbom is None:
        got = hashlib.sha256(sboms[-1]).hexdigest()
        raise Refused(f"{what}: the attached SBOM (sha256 {got[:16]}…) is not the one the provenance records "
                        f"(sha256 {recorded.sbom_sha256[:16]}…)")
    inputs = _local_inputs(files, recorded, platform)
    result = {"tag": recorded.tag, "sm": recorded.sm, "platform": f"{platform} sm_{recorded.sm}"}
    with tempfile.TemporaryDirectory(prefix="kiln-check-") as tmp:
        cache = Path(tmp)
        _share_toolchains(cache)
        # an image built from an unlocked pin re-resolves its base tag (a moved tag shows as a base layer)
        prepared = prepare_build(inputs, config, allow_unlocked=not inputs.pin.digest, cache=cache,
                                 reporter=reporter)
        if recorded.warm:  # compile output is not re-derivable: the image's own warm layer, checked, on top
            prepared = rewarm(client, repo, manifest, prepared, recorded.warm, what, cache)
            result["warm"] = manifest.layers[-1].digest
        (cache / "work").mkdir()
        image = bake(prepared, cache / "work", reporter)
        if image.manifest.digest != digest:
            difference = describe_difference(manifest, image, client, repo, cache)
            return CheckResult(reference, digest, signed_by, False, difference, **result), image
        sbom_again, provenance_again = attestations(image)
        _, statement_again, _ = open_envelope(provenance_again.blobs[provenance_again.manifest.json["layers"][0]["digest"]], "")
        if sbom_again.blobs[sbom_again.manifest.json["layers"][0]["digest"]] != sbom:
            return CheckResult(reference, digest, signed_by, False, "the SBOM differs from the re-derived one",
                               **result), image
        if statement_again != payload:
            return CheckResult(reference, digest, signed_by, False, "the provenance differs from the re-derived one",
                               **result), image
    return CheckResult(reference, digest, signed_by, True, **result), image
