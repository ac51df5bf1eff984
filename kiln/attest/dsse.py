"""DSSE envelopes (https://github.com/secure-systems-lab/dsse): PAE, signing, verifying.

Public API:
    PAYLOAD_TYPE                      "application/vnd.in-toto+json"
    pae(payload_type, payload) -> bytes
    SigningKey                        load_signing_key(path) -> SigningKey   (.keyid, .sign(data))
    load_public_key(path) -> public key
    keyid_of(public_key) -> str       sha256 of the key's SubjectPublicKeyInfo (DER), hex
    envelope(payload, key=None, payload_type=PAYLOAD_TYPE) -> bytes   canonical JSON; no key: no signature
    open_envelope(data, what) -> (payload_type, payload: bytes, signatures: list[dict])
    verify_envelope(data, public_key, what) -> bytes  the payload, once a signature verifies

Keys are ECDSA P-256 (signatures DER-encoded over SHA-256, as DSSE's reference signers do) or
Ed25519. An Ed25519 envelope is byte-for-byte reproducible; an ECDSA signature is not (its
nonce is random), but the payload it signs is.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from kiln.attest import Refused
from kiln.errors import KilnError
from kiln.oci.mutate import canonical_json

PAYLOAD_TYPE = "application/vnd.in-toto+json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what a signature covers."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def keyid_of(public_key) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _check_kind(key, where: str) -> None:
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        if key.curve.name != "secp256r1":
            raise KilnError(f"{where}: ECDSA key on {key.curve.name}; kiln signs with P-256 (secp256r1) or Ed25519")
    elif not isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        raise KilnError(f"{where}: {type(key).__name__.lstrip('_')} is not an ECDSA P-256 or Ed25519 key")


@dataclass(frozen=True)
class SigningKey:
    private: object
    path: Path

    @property
    def keyid(self) -> str:
        return keyid_of(self.private.public_key())

    def sign(self, data: bytes) -> bytes:
        if isinstance(self.private, ed25519.Ed25519PrivateKey):
            return self.private.sign(data)
        return self.private.sign(data, ec.ECDSA(hashes.SHA256()))


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise KilnError(f"{what} {path}: cannot read ({err.strerror})") from None


def load_signing_key(path: Path) -> SigningKey:
    """An unencrypted PEM private key (PKCS#8 or SEC1), ECDSA P-256 or Ed25519."""
    data = _read(path, "--sign-key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise KilnError(f"--sign-key {path}: not an unencrypted PEM private key ({err})") from None
    _check_kind(key, f"--sign-key {path}")
    return SigningKey(key, Path(path))


def load_public_key(path: Path):
    """A PEM public key (SubjectPublicKeyInfo), ECDSA P-256 or Ed25519."""
    data = _read(path, "--key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as err:
        raise KilnError(f"--key {path}: not a PEM public key ({err})") from None
    _check_kind(key, f"--key {path}")
    return key


def envelope(payload: bytes, key: SigningKey | None = None, payload_type: str = PAYLOAD_TYPE) -> bytes:
    signatures = []
    if key is not None:
        sig = key.sign(pae(payload_type, payload))
        signatures.append({"keyid": key.keyid, "sig": base64.b64encode(sig).decode()})
    return canonical_json({"payload": base64.b64encode(payload).decode(), "payloadType": payload_type,
                           "signatures": signatures})


def open_envelope(data: bytes, what: str) -> tuple[str, bytes, list[dict]]:
    try:
        env = json.loads(data)
        payload = base64.b64decode(env["payload"], validate=True)
        payload_type = env["payloadType"]
        signatures = env.get("signatures") or []
        if not isinstance(payload_type, str) or not isinstance(signatures, list):
            raise TypeError("payloadType or signatures of the wrong type")
    except (ValueError, KeyError, TypeError) as err:
        raise Refused(f"{what}: not a DSSE envelope ({err})") from None
    return payload_type, payload, signatures


def verify_envelope(data: bytes, public_key, what: str) -> bytes:
    """The payload, once one signature verifies with ``public_key``; else a one-line refusal."""
    payload_type, payload, signatures = open_envelope(data, what)
    if not signatures:
        raise Refused(f"{what}: is not signed; --key needs a signed provenance")
    message = pae(payload_type, payload)
    for signature in signatures:
        try:
            sig = base64.b64decode(signature.get("sig", ""), validate=True)
            if isinstance(public_key, ed25519.Ed25519PublicKey):
                public_key.verify(sig, message)
            else:
                public_key.verify(sig, message, ec.ECDSA(hashes.SHA256()))
            return payload
        except (InvalidSignature, ValueError, AttributeError):
            continue
    raise Refused(f"{what}: no signature verifies with the given key (keyid {keyid_of(public_key)[:16]}…)")
