"""``check`` of an image with a warm layer: every other layer re-derived, the warm one verified.

Public API:
    rewarm(client, repository, manifest, prepared, recorded_warm, what, workdir) -> PreparedBuild

Compile output is not bit-reproducible across hosts (Inductor's and Triton's binaries carry
timings, paths of the compiling process, the host's compiler), so ``check`` cannot make the warm
layer again. It takes the layer's files from the pulled image instead, and bakes them on the
re-derived build with the same ``bake_warm`` a build uses: the key re-derived from the
re-made audit record must be the one recorded, each file must be the one the image's audit file
lists by sha256, and the audit's warm record must be the one the provenance names. The image is
then compared whole as usual, so the warm layer is the one whose digest the (signed) provenance's
subject fixes: verified by its recorded digest and the provenance's signature, not re-derived.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from kiln.attest import Refused
from kiln.errors import KilnError
from kiln.image.layers import AUDIT_PATH
from kiln.image.prepare import PreparedBuild
from kiln.image.warmlayer import bake_warm
from kiln.oci.manifest import Descriptor, Manifest
from kiln.oci.registry import RegistryClient

_INFLATED_MAX = 8 << 30  # a warm layer of one GPU model's caches: hundreds of MB; past this it is not kiln's


def rewarm(client: RegistryClient, repository: str, manifest: Manifest, prepared: PreparedBuild,
           recorded_warm: dict, what: str, workdir: Path) -> PreparedBuild:
    """``prepared`` (re-derived, no warm layer) with the pulled image's warm layer baked on top;
    refused in one line when the layer, the audit file and the provenance do not agree."""
    layers = manifest.layers
    base = len(layers) - len(prepared.layers) - 1  # the base's layers, then kiln's, the warm one last
    if base < 0:
        raise Refused(f"{what}: {len(layers)} layers, fewer than the re-derived build's {len(prepared.layers)} "
                      "and a warm layer")
    warm_layer = layers[-1]
    where = f"{what}: warm layer {warm_layer.digest}"
    try:
        audit = json.loads(_files(client, repository, layers[base], workdir, {AUDIT_PATH})[AUDIT_PATH])
    except (KeyError, ValueError):
        raise Refused(f"{what}: layer {base} ({layers[base].digest}) holds no readable /{AUDIT_PATH}") from None
    summary = audit.get("warm") if isinstance(audit, dict) else None
    if not isinstance(summary, dict) or summary.get("record_sha256") != recorded_warm["record_sha256"] \
            or summary.get("key") != recorded_warm["key"]:
        raise Refused(f"{what}: the audit file's warm record is not the one the provenance records "
                      f"(sha256 {recorded_warm['record_sha256'][:16]}…)")
    try:
        return bake_warm(prepared, summary, _files(client, repository, warm_layer, workdir), where)
    except Refused:
        raise
    except KilnError as err:  # another build's key, a file not as listed: the image is not what it claims
        raise Refused(str(err)) from None


def _files(client: RegistryClient, repository: str, layer: Descriptor, workdir: Path,
           only: set[str] | None = None) -> dict[str, bytes]:
    """The regular files of ``layer`` (``only`` those paths), its blob verified against its digest."""
    path = workdir / f"warmcheck-{layer.digest.split(':', 1)[1]}"
    try:
        with client.open_blob(repository, layer.digest, layer.size) as reader, path.open("wb") as out:
            while chunk := reader.read(1 << 20):
                out.write(chunk)
        files, total = {}, 0
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isreg() or (only is not None and member.name not in only):
                    continue
                total += member.size
                if total > _INFLATED_MAX:
                    raise Refused(f"layer {layer.digest} inflates past {_INFLATED_MAX} bytes")
                files[member.name] = tar.extractfile(member).read()
        return files
    except (tarfile.TarError, OSError, EOFError) as err:
        raise Refused(f"layer {layer.digest} is not a readable tar: {err}") from None
    except Refused:
        raise
    except KilnError as err:  # the registry's bytes are not the digest the manifest names
        raise Refused(str(err)) from None
    finally:
        path.unlink(missing_ok=True)
