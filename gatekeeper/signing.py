"""SSH signatures (OpenSSH's SSHSIG format) and git's ``allowed_signers``: who vouched for a record.

A signature made here verifies with ``ssh-keygen -Y verify -n gatekeeper``, and one made with
``ssh-keygen -Y sign -n gatekeeper`` verifies here. Only the framing (PROTOCOL.sshsig) is written
out below; every primitive (hashing, ed25519, RSA, ECDSA) is the ``cryptography`` package's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from .errors import GatekeeperError

NAMESPACE = "gatekeeper"
SIGNING_KEY_ENV = "GATEKEEPER_SIGNING_KEY"
_MAGIC = b"SSHSIG"
_VERSION = 1
_ARMOR_BEGIN, _ARMOR_END = "-----BEGIN SSH SIGNATURE-----", "-----END SSH SIGNATURE-----"
_HASHES = {"sha512": hashlib.sha512, "sha256": hashlib.sha256}
_CURVES = {"nistp256": (ec.SECP256R1, hashes.SHA256), "nistp384": (ec.SECP384R1, hashes.SHA384),
           "nistp521": (ec.SECP521R1, hashes.SHA512)}
_RSA_SIG = {"rsa-sha2-512": hashes.SHA512, "rsa-sha2-256": hashes.SHA256}  # never ssh-rsa (SHA-1)
KEY_TYPES = ("ssh-ed25519", "ssh-rsa", *(f"ecdsa-sha2-{c}" for c in _CURVES))


class BadSignature(Exception):
    """The signature is malformed, for another namespace, or does not match the message."""


# --- the SSH wire format (RFC 4251 strings and mpints) -----------------------------------------


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _mpint(n: int) -> bytes:
    return _string(n.to_bytes(n.bit_length() // 8 + 1, "big") if n else b"")  # +1 byte keeps it positive


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise BadSignature("truncated")
        out, self.at = self.data[self.at:self.at + n], self.at + n
        return out

    def uint32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def string(self) -> bytes:
        return self.take(self.uint32())

    def mpint(self) -> int:
        return int.from_bytes(self.string(), "big", signed=True)

    def end(self) -> None:
        if self.at != len(self.data):
            raise BadSignature("trailing bytes")


# --- keys --------------------------------------------------------------------------------------


def key_type(blob: bytes) -> str:
    try:
        return _Reader(blob).string().decode("ascii")
    except (BadSignature, UnicodeDecodeError):
        return "?"


def fingerprint(blob: bytes) -> str:
    """A public key's fingerprint as ``ssh-keygen -l`` prints it: SHA256:base64, unpadded."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def public_key(blob: bytes) -> Any:
    """A ``cryptography`` public key from an SSH public key blob."""
    kind = key_type(blob)
    if kind not in KEY_TYPES:
        raise BadSignature(f"key type {kind} is not supported (use {', '.join(KEY_TYPES)})")
    try:
        return serialization.load_ssh_public_key(kind.encode() + b" " + base64.b64encode(blob))
    except (ValueError, UnsupportedAlgorithm) as e:
        raise BadSignature(f"unreadable {kind} key: {e}") from None


def _blob(public: Any) -> bytes:
    text = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return base64.b64decode(text.split()[1])


@dataclass(frozen=True)
class SigningKey:
    """A private key read from an OpenSSH (or PEM) key file."""

    path: Path
    private: Any
    blob: bytes  # the public key, SSH wire format

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.blob)

    def sign(self, message: bytes, namespace: str = NAMESPACE) -> str:
        return sign(self, message, namespace)


def load_key(path: str | os.PathLike) -> SigningKey:
    """A private key file; every problem is a GatekeeperError that says what to pass instead."""
    p = Path(path).expanduser()
    where = f"signing key {p}"
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise GatekeeperError(f"{where}: no such file; pass --sign with an SSH private key file "
                              f"(e.g. ~/.ssh/id_ed25519) or set ${SIGNING_KEY_ENV}") from None
    except OSError as e:
        raise GatekeeperError(f"{where}: cannot read it ({e.strerror})") from None
    text = data.lstrip()
    if text.startswith(tuple(t.encode() for t in KEY_TYPES)) or text.startswith(b"sk-"):
        raise GatekeeperError(f"{where}: this is a public key; pass the private key file (the one without .pub)")
    private: object  # each cryptography release widens the loaders' unions; narrowed below
    try:
        if text.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----"):
            private = serialization.load_ssh_private_key(data, password=None)
        else:
            private = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # the key is encrypted and no password was given
        raise GatekeeperError(
            f"{where}: the key is protected by a passphrase, which gatekeeper does not ask for; sign with "
            f"ssh-keygen instead (it can use ssh-agent): 'gatekeeper flip ... --print-record > rec', "
            f"'ssh-keygen -Y sign -n {NAMESPACE} -f KEY rec', then 'gatekeeper flip ... --record rec --signature rec.sig'"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as e:
        raise GatekeeperError(f"{where}: not an SSH private key gatekeeper can read ({e}); "
                              f"use an ed25519, RSA or ECDSA key made by ssh-keygen") from None
    if isinstance(private, rsa.RSAPrivateKey) and private.key_size < 2048:
        raise GatekeeperError(f"{where}: RSA keys under 2048 bits are refused; make an ed25519 key (ssh-keygen -t ed25519)")
    if isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name not in {c[0].name for c in _CURVES.values()}:
        raise GatekeeperError(f"{where}: ECDSA curve {private.curve.name} is not supported; use nistp256, 384 or 521")
    if not isinstance(private, (ed25519.Ed25519PrivateKey, rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey)):
        raise GatekeeperError(f"{where}: {type(private).__name__} keys are not supported; use ed25519, RSA or ECDSA")
    return SigningKey(p, private, _blob(private.public_key()))


# --- SSHSIG ------------------------------------------------------------------------------------


def _signed_data(namespace: str, hash_alg: str, message: bytes) -> bytes:
    """What the key actually signs (PROTOCOL.sshsig): the preamble, namespace and H(message)."""
    return (_MAGIC + _string(namespace.encode()) + _string(b"") + _string(hash_alg.encode())
            + _string(_HASHES[hash_alg](message).digest()))


def _raw_sign(private: Any, data: bytes) -> bytes:
    """The SSH signature blob: string(algorithm) || string(signature bytes)."""
    if isinstance(private, ed25519.Ed25519PrivateKey):
        return _string(b"ssh-ed25519") + _string(private.sign(data))
    if isinstance(private, rsa.RSAPrivateKey):
        return _string(b"rsa-sha2-512") + _string(private.sign(data, padding.PKCS1v15(), hashes.SHA512()))
    curve = next(name for name, (c, _) in _CURVES.items() if c.name == private.curve.name)
    r, s = decode_dss_signature(private.sign(data, ec.ECDSA(_CURVES[curve][1]())))
    return _string(f"ecdsa-sha2-{curve}".encode()) + _string(_mpint(r) + _mpint(s))


def _raw_verify(blob: bytes, signature: bytes, data: bytes) -> None:
    key, kind = public_key(blob), key_type(blob)
    r = _Reader(signature)
    alg = r.string().decode("ascii", "replace")
    raw = r.string()
    r.end()
    try:
        if kind == "ssh-ed25519" and alg == kind:
            key.verify(raw, data)
        elif kind == "ssh-rsa" and alg in _RSA_SIG:
            key.verify(raw, data, padding.PKCS1v15(), _RSA_SIG[alg]())
        elif kind.startswith("ecdsa-sha2-") and alg == kind:
            rs = _Reader(raw)
            der = encode_dss_signature(rs.mpint(), rs.mpint())
            rs.end()
            key.verify(der, data, ec.ECDSA(_CURVES[kind.removeprefix("ecdsa-sha2-")][1]()))
        else:
            raise BadSignature(f"signature algorithm {alg} does not fit a {kind} key")
    except InvalidSignature:
        raise BadSignature("the signature does not match the message") from None


def sign(key: SigningKey, message: bytes, namespace: str = NAMESPACE) -> str:
    """An armored SSH signature of ``message``, as ``ssh-keygen -Y sign -n NAMESPACE`` makes one."""
    blob = (_MAGIC + struct.pack(">I", _VERSION) + _string(key.blob) + _string(namespace.encode()) + _string(b"")
            + _string(b"sha512") + _string(_raw_sign(key.private, _signed_data(namespace, "sha512", message))))
    text = base64.b64encode(blob).decode()
    return "\n".join([_ARMOR_BEGIN, *(text[i:i + 70] for i in range(0, len(text), 70)), _ARMOR_END]) + "\n"


@dataclass(frozen=True)
class Signature:
    blob: bytes  # the signer's public key
    namespace: str
    hash_alg: str
    signature: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.blob)


def parse(armored: str) -> Signature:
    """An armored SSH signature's fields; BadSignature when it is not one."""
    lines = [line.strip() for line in armored.strip().splitlines()]
    if len(lines) < 3 or lines[0] != _ARMOR_BEGIN or lines[-1] != _ARMOR_END:
        raise BadSignature(f"not an SSH signature (it must start with {_ARMOR_BEGIN})")
    try:
        blob = base64.b64decode("".join(lines[1:-1]), validate=True)
    except (binascii.Error, ValueError):
        raise BadSignature("the signature's base64 is damaged") from None
    r = _Reader(blob)
    if r.take(6) != _MAGIC or r.uint32() != _VERSION:
        raise BadSignature("not an SSHSIG version 1 signature")
    key, namespace, _reserved, hash_alg, signature = r.string(), r.string(), r.string(), r.string(), r.string()
    r.end()
    try:
        return Signature(key, namespace.decode(), hash_alg.decode(), signature)
    except UnicodeDecodeError:
        raise BadSignature("the signature's namespace or hash name is not text") from None


def verify(armored: str, message: bytes, namespace: str = NAMESPACE) -> Signature:
    """Check ``armored`` over ``message`` in ``namespace``; returns it parsed, else raises BadSignature.
    This proves only that the key in the signature signed it: whose key it is, ``AllowedSigners`` says."""
    sig = parse(armored)
    if sig.namespace != namespace:
        raise BadSignature(f"the signature is for namespace {sig.namespace!r}, not {namespace!r}")
    if sig.hash_alg not in _HASHES:
        raise BadSignature(f"hash {sig.hash_alg!r} is not sha512 or sha256")
    _raw_verify(sig.blob, sig.signature, _signed_data(namespace, sig.hash_alg, message))
    return sig


# --- allowed_signers (git's format, as ssh-keygen -Y verify reads it) --------------------------


@dataclass(frozen=True)
class Signer:
    principals: tuple[str, ...]
    blob: bytes
    line: int
    namespaces: tuple[str, ...] | None = None  # None: any namespace
    valid_after: datetime | None = None
    valid_before: datetime | None = None

    def allows(self, blob: bytes, at: datetime, namespace: str = NAMESPACE) -> bool:
        import fnmatch

        return (blob == self.blob
                and (self.namespaces is None or any(fnmatch.fnmatchcase(namespace, p) for p in self.namespaces))
                and (self.valid_after is None or at >= self.valid_after)
                and (self.valid_before is None or at < self.valid_before))


def _fields(line: str) -> list[str]:
    """Whitespace-separated fields; a double-quoted run (which may hold spaces) stays in its field."""
    out, cur, quoted = [], "", False
    for ch in line:
        if ch == '"':
            quoted = not quoted
        if ch.isspace() and not quoted:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    if quoted:
        raise ValueError("a quote is not closed")
    return out + ([cur] if cur else [])


def _split_options(text: str) -> list[str]:
    out, cur, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def _timestamp(value: str) -> datetime:
    """ssh-keygen's YYYYMMDD[HHMM[SS]][Z]: UTC with Z, else local time."""
    utc = value.endswith(("Z", "z"))
    digits = value.rstrip("Zz")
    formats = {8: "%Y%m%d", 12: "%Y%m%d%H%M", 14: "%Y%m%d%H%M%S"}
    if not digits.isdigit() or len(digits) not in formats:
        raise ValueError(f"timestamp {value!r} is not YYYYMMDD[HHMM[SS]][Z]")
    stamp = datetime.strptime(digits, formats[len(digits)])
    return stamp.replace(tzinfo=timezone.utc) if utc else stamp.astimezone(timezone.utc)


def _signer(line: str, number: int) -> Signer:
    fields = _fields(line)
    if len(fields) < 3:
        raise ValueError("expected 'principal key-type key' (e.g. 'ana@example.org ssh-ed25519 AAAA...')")
    principals = tuple(p.strip('"') for p in fields[0].split(","))
    if any(not p or any(c in p for c in "*?!") for p in principals):
        raise ValueError(f"principal {fields[0]!r}: name each principal (patterns with *, ? or ! are not supported)")
    rest = fields[1:]
    options: dict[str, str] = {}
    if rest[0].startswith(("ssh-", "ecdsa-", "sk-")) and rest[0] not in KEY_TYPES:
        raise ValueError(f"key type {rest[0]!r} is not supported; use one of {', '.join(KEY_TYPES)}")
    if rest[0] not in KEY_TYPES:
        for opt in _split_options(rest.pop(0)):
            name, eq, value = opt.partition("=")
            name = name.lower()
            if name == "cert-authority":
                raise ValueError("cert-authority is not supported; list each signer's own key")
            if name not in ("namespaces", "valid-after", "valid-before") or not eq:
                raise ValueError(f"unknown option {opt!r}; gatekeeper reads namespaces=, valid-after=, valid-before=")
            options[name] = value.strip('"')
    if len(rest) < 2:
        raise ValueError("expected a key type and a base64 key after the principal")
    kind, b64 = rest[0], rest[1]
    if kind not in KEY_TYPES:
        raise ValueError(f"key type {kind!r} is not supported; use one of {', '.join(KEY_TYPES)}")
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the key is not valid base64") from None
    if key_type(blob) != kind:
        raise ValueError(f"the key is not a {kind} key")
    try:
        public_key(blob)
    except BadSignature as e:
        raise ValueError(str(e)) from None
    namespaces = options.get("namespaces")
    return Signer(
        principals, blob, number,
        tuple(n.strip() for n in namespaces.split(",")) if namespaces is not None else None,
        _timestamp(options["valid-after"]) if options.get("valid-after") else None,
        _timestamp(options["valid-before"]) if options.get("valid-before") else None,
    )


@dataclass(frozen=True)
class AllowedSigners:
    """``policies/allowed_signers``: which key may sign for which principal, and when."""

    path: Path
    signers: tuple[Signer, ...]

    @classmethod
    def load(cls, path: Path) -> AllowedSigners:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise GatekeeperError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                                  "it holds lines 'principal key-type key'") from None
        except OSError as e:
            raise GatekeeperError(f"{path}: cannot be read ({e.strerror or e})") from None
        signers = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                signers.append(_signer(line, number))
            except (ValueError, BadSignature, struct.error, OverflowError) as e:
                raise GatekeeperError(f"{path}, line {number}: {e}") from None
        return cls(path, tuple(signers))

    def principal(self, blob: bytes, at: datetime, namespace: str = NAMESPACE) -> str | None:
        """The principal this key signs for at ``at`` (the first line that allows it), else None."""
        for s in self.signers:
            if s.allows(blob, at, namespace):
                return s.principals[0]
        return None

    def allows(self, principal: str, blob: bytes, at: datetime, namespace: str = NAMESPACE) -> bool:
        return any(principal in s.principals and s.allows(blob, at, namespace) for s in self.signers)


def parse_time(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))
