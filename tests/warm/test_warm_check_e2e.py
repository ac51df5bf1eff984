"""``check`` on a signed image with a warm layer, pushed to the real test registry: every other layer
is re-derived and the warm one verified by the digest the signed provenance records (one line
says so); a warm layer tampered with after signing is refused in one line naming the file."""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from kiln import commands
from tests.attest.test_trust_e2e import (
    DSSE_TYPE,
    SBOM_TYPE,
    Registry,
    _artifact,
    _attached,
    _keyid,
    _pem_pair,
    _set_referrers,
    _sha,
)
from tests.image.test_build_e2e import IMAGES, TAG
from tests.warm.test_warm_build_e2e import CACHE, _bundle, _layout

pytestmark = pytest.mark.registry


def _check(capsys, project, ref: str, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = commands.main(["--pins", str(project.pins()), "--images", str(IMAGES), "check", ref,
                          "--mirror", project.registry.mirror, *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def _tampered_warm_layer(raw: Registry, repo: str, path: str) -> tuple[bytes, bytes]:
    """The image under ``TAG`` with one file of its warm (top) layer rewritten, config and manifest to match,
    pushed under ``TAG``; the original manifest and the tampered one."""
    original, _ = raw.manifest(repo, TAG)
    body = json.loads(original)
    layer = body["layers"][-1]
    tar_in = tarfile.open(fileobj=io.BytesIO(gzip.decompress(raw.blob(repo, layer["digest"]))))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar_out:
        for member in tar_in.getmembers():
            data = tar_in.extractfile(member).read() if member.isfile() else None
            if member.name == path:
                data = b"a kernel that does something else"
                member.size = len(data)
            tar_out.addfile(member, io.BytesIO(data) if data is not None else None)
    plain = out.getvalue()
    packed = gzip.compress(plain, mtime=0)
    config = json.loads(raw.blob(repo, body["config"]["digest"]))
    config["rootfs"]["diff_ids"][-1] = _sha(plain)
    config_bytes = json.dumps(config).encode()
    body["config"] = {**body["config"], "digest": raw.put_blob(repo, config_bytes), "size": len(config_bytes)}
    body["layers"][-1] = {**layer, "digest": raw.put_blob(repo, packed), "size": len(packed)}
    tampered = json.dumps(body).encode()
    raw.put_manifest(repo, TAG, tampered)
    return original, tampered


def test_check_verifies_the_warm_layer_by_its_signed_digest_and_refuses_a_tampered_one(project, capsys, tmp_path):
    key, pub = _pem_pair(ed25519.Ed25519PrivateKey.generate(), tmp_path, "signer")
    code, _, err = project.build(capsys, "--oci", str(tmp_path / "cold"))
    assert code == 0, err
    manifest, _, _, blob = _layout(tmp_path / "cold")
    with tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][-1]["digest"])), mode="r:gz") as tar:
        audit = json.loads(tar.extractfile("opt/kiln/manifest.json").read())
    bundle = _bundle(project, tmp_path, audit, "bundle")
    raw, repo = Registry(project.registry), project.dest
    code, warm, err = project.build(capsys, "--warm", str(bundle), "--push", "--repository",
                                    f"{raw.host}/{repo}", "--sign-key", str(key))
    assert code == 0, err
    pushed, _ = raw.manifest(repo, TAG)
    warm_digest = json.loads(pushed)["layers"][-1]["digest"]

    code, out, err = _check(capsys, project, f"{raw.host}/{repo}:{TAG}", "--key", str(pub))
    assert code == 0, err
    identical, line = out.strip().splitlines()
    assert identical.startswith("identical:") and warm["manifest_digest"] in identical
    assert line.startswith(f"warm layer {warm_digest}: verified by the digest the provenance records and its "
                           f"signature (key {_keyid(pub)}); not re-derived"), line
    code, out, _ = _check(capsys, project, f"{raw.host}/{repo}:{TAG}")
    assert code == 0 and f"warm layer {warm_digest}: the digest the provenance records, but its signature is " \
        "not verified (no --key), so neither is the warm layer" in out

    # an attacker with push access and no key: one compiled file rewritten, the provenance re-made unsigned
    target = sorted(CACHE)[0]
    original, tampered = _tampered_warm_layer(raw, repo, target)
    found = _attached(raw, repo, _sha(original))
    envelope = json.loads(found[DSSE_TYPE][1])
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["subject"][0]["digest"]["sha256"] = _sha(tampered).split(":")[1]
    forged = json.dumps({"payload": base64.b64encode(json.dumps(statement).encode()).decode(),
                         "payloadType": envelope["payloadType"], "signatures": []}).encode()
    _set_referrers(raw, repo, _sha(tampered), [_artifact(raw, repo, SBOM_TYPE, found[SBOM_TYPE][1], tampered),
                                               _artifact(raw, repo, DSSE_TYPE, forged, tampered)])
    code, _, err = _check(capsys, project, f"{raw.host}/{repo}:{TAG}", "--key", str(pub))
    assert code == 1 and "is not signed" in err.strip().splitlines()[-1], err
    code, out, err = _check(capsys, project, f"{raw.host}/{repo}:{TAG}")
    lines = err.strip().splitlines()
    assert code == 1 and not out and all(line.startswith("warning: ") for line in lines[:-1]), err
    assert lines[-1].startswith("refused: ") and f"warm layer {json.loads(tampered)['layers'][-1]['digest']}" \
        in lines[-1] and f"/{target} is not the file the warm record lists" in lines[-1], lines[-1]
