"""DSSE envelopes kiln writes, checked against the spec's PAE and securesystemslib (no registry)."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from kiln.attest import Refused
from kiln.attest.dsse import (
    envelope,
    keyid_of,
    load_public_key,
    load_signing_key,
    pae,
    verify_envelope,
)
from kiln.errors import KilnError


def _write(private, tmp_path, name):
    key = tmp_path / f"{name}.pem"
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    pub = tmp_path / f"{name}.pub"
    pub.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, pub


def test_pae_is_the_spec_encoding():
    # the DSSE protocol document's worked example
    assert pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


@pytest.mark.parametrize("make", [lambda: ec.generate_private_key(ec.SECP256R1()), ed25519.Ed25519PrivateKey.generate],
                         ids=["ecdsa-p256", "ed25519"])
def test_signed_envelope_verifies_with_securesystemslib_and_kiln(tmp_path, make):
    key_path, pub_path = _write(make(), tmp_path, "k")
    key = load_signing_key(key_path)
    payload = b'{"_type":"https://in-toto.io/Statement/v1"}'
    data = envelope(payload, key)
    public = load_public_key(pub_path)
    accepted = Envelope.from_dict(json.loads(data)).verify([SSlibKey.from_crypto(public, keyid_of(public))], 1)
    assert list(accepted) == [keyid_of(public)]
    assert verify_envelope(data, public, "test") == payload
    # a changed payload no longer verifies
    body = json.loads(data)
    body["payload"] = base64.b64encode(payload.replace(b"v1", b"v2")).decode()
    with pytest.raises(Refused, match="no signature verifies"):
        verify_envelope(json.dumps(body).encode(), public, "test")


def test_unsigned_envelope_is_valid_but_not_for_a_key(tmp_path):
    _, pub_path = _write(ed25519.Ed25519PrivateKey.generate(), tmp_path, "k")
    data = envelope(b"{}")
    assert json.loads(data)["signatures"] == []
    with pytest.raises(Refused, match="is not signed"):
        verify_envelope(data, load_public_key(pub_path), "prov")


def test_other_key_kinds_are_refused_in_one_line(tmp_path):
    key_path, pub_path = _write(ec.generate_private_key(ec.SECP384R1()), tmp_path, "p384")
    with pytest.raises(KilnError, match="secp384r1; kiln signs with P-256"):
        load_signing_key(key_path)
    key_path, _ = _write(rsa.generate_private_key(65537, 2048), tmp_path, "rsa")
    with pytest.raises(KilnError, match="is not an ECDSA P-256 or Ed25519 key"):
        load_signing_key(key_path)
    (tmp_path / "junk.pem").write_text("nope")
    with pytest.raises(KilnError, match="junk.pem: not an unencrypted PEM private key"):
        load_signing_key(tmp_path / "junk.pem")


@pytest.mark.isolated
def test_a_bad_sign_key_is_refused_before_any_pull(tmp_path, capsys):
    from kiln import commands
    from tests.support import TEST_IMAGES

    pins = tmp_path / "pins.toml"
    pins.write_text('[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
                    'vllm = "0.20.1"\ncuda = "cu130"\ndigest = "sha256:' + "0" * 64 + '"\n')
    key_path, _ = _write(ec.generate_private_key(ec.SECP384R1()), tmp_path, "p384")
    # the mirror is a closed port: any request would fail with a connection error instead
    code = commands.main(["--pins", str(pins), "--images", str(TEST_IMAGES), "build", "--image", "e2e-p65",
                          "--pin", "v0.20.1", "--sm", "120", "--mirror", "docker.io=http://127.0.0.1:9",
                          "--oci", str(tmp_path / "out"), "--sign-key", str(key_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --sign-key ") and "secp384r1" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
