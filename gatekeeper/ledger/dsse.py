"""DSSE, the Dead Simple Signing Envelope (secure-systems-lab/dsse, protocol v1), signed with SSH keys.

A payload and its type are signed through PAE, so a signature cannot be moved to another type. Each key
signs with its own raw algorithm under the scheme name securesystemslib gives it, so an ``SSlibKey`` built
from the same public key verifies the envelope: ed25519 -> ``ed25519``; ECDSA -> ``ecdsa-sha2-nistp256``,
``-nistp384``, ``-nistp521`` (DER signatures); RSA -> ``rsassa-pss-sha256``. A signature's ``keyid`` is the
key's OpenSSH fingerprint (``SHA256:...``, as ``ssh-keygen -l`` prints it), which every side can recompute.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from gatekeeper import signing
from gatekeeper.errors import GatekeeperError
from gatekeeper.signing import BadSignature, SigningKey

_EC_HASH = {"secp256r1": ("nistp256", hashes.SHA256), "secp384r1": ("nistp384", hashes.SHA384),
            "secp521r1": ("nistp521", hashes.SHA512)}


@dataclass(frozen=True)
class Envelope:
    payload_type: str
    payload: bytes
    signatures: tuple[tuple[str, bytes], ...]  # (keyid, signature bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"payloadType": self.payload_type, "payload": base64.b64encode(self.payload).decode(),
                "signatures": [{"keyid": k, "sig": base64.b64encode(s).decode()} for k, s in self.signatures]}


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSEv1's pre-authentication encoding: the bytes a signature covers. Lengths are byte counts in ASCII decimal."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def keyid(blob: bytes) -> str:
    return signing.fingerprint(blob)


def scheme(public: Any) -> str:
    """securesystemslib's scheme name for a ``cryptography`` public key (its ``SSlibKey.from_crypto`` default)."""
    if isinstance(public, ed25519.Ed25519PublicKey):
        return "ed25519"
    if isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name in _EC_HASH:
        return "ecdsa-sha2-" + _EC_HASH[public.curve.name][0]
    if isinstance(public, rsa.RSAPublicKey):
        return "rsassa-pss-sha256"
    raise BadSignature(f"{type(public).__name__} keys cannot sign DSSE envelopes here; use ed25519, ECDSA or RSA")


def sign(key: SigningKey, payload_type: str, payload: bytes) -> Envelope:
    data, private = pae(payload_type, payload), key.private
    if isinstance(private, ed25519.Ed25519PrivateKey):
        sig = private.sign(data)
    elif isinstance(private, ec.EllipticCurvePrivateKey):
        sig = private.sign(data, ec.ECDSA(_EC_HASH[private.curve.name][1]()))
    else:  # RSA (load_key admits nothing else); salt as long as the digest, as securesystemslib signs
        sig = private.sign(data, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.DIGEST_LENGTH), hashes.SHA256())
    return Envelope(payload_type, payload, ((keyid(key.blob), sig),))


def verify(blob: bytes, sig: bytes, payload_type: str, payload: bytes) -> None:
    """Check one signature with the SSH public key ``blob``; BadSignature when it does not match."""
    public, data = signing.public_key(blob), pae(payload_type, payload)
    try:
        if isinstance(public, ed25519.Ed25519PublicKey):
            public.verify(sig, data)
        elif isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(sig, data, ec.ECDSA(_EC_HASH[public.curve.name][1]()))
        else:  # any salt length: securesystemslib's own RSA signatures verify here too
            public.verify(sig, data, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.AUTO), hashes.SHA256())
    except (InvalidSignature, ValueError):
        raise BadSignature(f"the {scheme(public)} signature does not match the payload") from None


def _b64(text: Any) -> bytes:
    """DSSE allows standard or URL-safe base64; either is read."""
    if not isinstance(text, str):
        raise ValueError("not a base64 string")
    text = text.strip().replace("-", "+").replace("_", "/")
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def parse(text: str, source: str) -> Envelope:
    """A DSSE envelope in its JSON form; GatekeeperError (exit 2) naming ``source`` and the field when it is not one."""
    fix = "pass the file 'gatekeeper ledger attest ID --sign KEY --out FILE' wrote"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise GatekeeperError(f"{source}: not JSON ({str(e).splitlines()[0] if str(e) else 'nested too deeply'}); {fix}") from None
    if not isinstance(data, dict):
        raise GatekeeperError(f"{source}: not a DSSE envelope (a JSON object with payloadType, payload, signatures); {fix}")
    for name in ("payloadType", "payload"):
        if not isinstance(data.get(name), str):
            raise GatekeeperError(f"{source}: field {name!r} is missing or not a string; {fix}")
    try:
        payload = _b64(data["payload"])
    except (binascii.Error, ValueError):
        raise GatekeeperError(f"{source}: field 'payload' is not base64; {fix}") from None
    sigs = data.get("signatures")
    if not isinstance(sigs, list) or not sigs:
        raise GatekeeperError(f"{source}: field 'signatures' is missing or empty; {fix}")
    out = []
    for i, s in enumerate(sigs):
        if not isinstance(s, dict) or not isinstance(s.get("keyid"), str) or not isinstance(s.get("sig"), str):
            raise GatekeeperError(f"{source}: signatures[{i}] is not {{\"keyid\": ..., \"sig\": ...}} with string values; {fix}")
        try:
            out.append((s["keyid"], _b64(s["sig"])))
        except (binascii.Error, ValueError):
            raise GatekeeperError(f"{source}: signatures[{i}].sig is not base64; {fix}") from None
    return Envelope(data["payloadType"], payload, tuple(out))
