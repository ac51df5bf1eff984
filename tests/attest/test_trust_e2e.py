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
import re
import tarfile
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from kiln import commands
from tests.support import TEST_IMAGES
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
    capsys.readouterr()
    code = commands.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


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
        code = commands.main(argv)
        assert code == 0
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
