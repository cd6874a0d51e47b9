"""Mutually authenticated CoAP over TLS (``coaps+tcp://``, RFC 8323): credentials, contexts, peer identity.

A device credential is one PEM file written by ``edgert keys enroll`` (docs/SECURITY.md)::

    # edgert credential name=pi-1 role=worker
    -----BEGIN PRIVATE KEY-----      the device's key
    -----BEGIN CERTIFICATE-----      the device's certificate (CN = name, OU = role), signed by:
    -----BEGIN CERTIFICATE-----      the cluster certificate (the cluster identity, a CA)
    -----BEGIN EDGERT OSCORE-----    OSCORE keys for coap:// (RFC 8613), see below

Both sides of every connection present their certificate and accept only
certificates the cluster signed (TLS 1.3, no hostname check: devices are
identified by certificate, not by address). A client that presents none may
still connect, so that every request it makes can be answered 4.01 (the server
checks :attr:`TlsCredentials.revocations` on each request too).

**The OSCORE block** (``coap://``, :mod:`edgert.transport.oscore`) is base64 (64-character
lines) of one CBOR map. In a worker's credential it is the device's pairwise OSCORE security
context with the coordinator, the inputs of RFC 8613 section 3.2::

    {"v": 1,
     "alg": "AES-CCM-16-64-128",         AEAD algorithm (COSE name); HKDF is HKDF-SHA-256
     "secret": bstr .size 32,            Master Secret
     "salt": bstr .size 8,               Master Salt
     "id_context": bstr,                 ID Context = CBOR [name, role, serial] of this device
     "sender_id": h'01',                 this device's Sender ID
     "recipient_id": h'00',              the coordinator's Sender ID
     "peer": [name, role, serial]}       the coordinator's identity (its certificate)

In the keystore's ``coordinator.pem`` it is ``{"v": 1, "root": bstr .size 32}``: the secret
every device's Master Secret and Salt derive from (:func:`edgert.transport.oscore_keys.device_context`);
other ``coordinator``-role credentials have no OSCORE block.
A credential without the block (enrolled before OSCORE) still works for ``coaps+tcp``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import ssl
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import cbor2
from cryptography import x509
from cryptography.x509.oid import NameOID

from edgert.transport import deadline
from edgert.transport.errors import CredentialError

#: The URL scheme of protected CoAP over TCP.
SCHEME = "coaps+tcp"

#: Roles a certificate's OU may name: the coordinator commands, workers train.
COORDINATOR_ROLE, WORKER_ROLE = "coordinator", "worker"
ROLES = (COORDINATOR_ROLE, WORKER_ROLE)

#: What a credential token (one line to paste on a board) starts with.
TOKEN_PREFIX = "edgert-credential:"

#: The PEM label of the OSCORE block of a credential.
OSCORE_LABEL = "EDGERT OSCORE"

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.S)


@dataclass(frozen=True)
class PeerIdentity:
    """Who is at the other end of a connection, from its verified certificate."""

    name: str
    role: str
    serial: int

    def __str__(self) -> str:
        return f"{self.role} {self.name!r}"


@dataclass(frozen=True)
class OscorePairwise:
    """A device's OSCORE security context with the coordinator (the OSCORE block of a worker credential)."""

    secret: bytes = field(repr=False)
    salt: bytes = field(repr=False)
    id_context: bytes
    sender_id: bytes
    recipient_id: bytes
    peer: PeerIdentity
    alg: str = "AES-CCM-16-64-128"

    def to_pem(self) -> bytes:
        """The OSCORE block of a credential file."""
        return _oscore_pem({"v": 1, "alg": self.alg, "secret": self.secret, "salt": self.salt,
                            "id_context": self.id_context, "sender_id": self.sender_id,
                            "recipient_id": self.recipient_id,
                            "peer": [self.peer.name, self.peer.role, self.peer.serial]})


@dataclass(frozen=True)
class OscoreRoot:
    """The coordinator's OSCORE root secret: every device's context derives from it and the device's identity."""

    root: bytes = field(repr=False)

    def to_pem(self) -> bytes:
        """The OSCORE block of a credential file."""
        return _oscore_pem({"v": 1, "root": self.root})


class Revocations:
    """Serial numbers of revoked certificates, replaced atomically by newer revocation lists."""

    def __init__(self, serials: Iterable[int] = (), number: int = 0) -> None:
        self._serials = frozenset(serials)
        self.number = number
        self._lock = threading.Lock()

    def __contains__(self, serial: object) -> bool:
        return serial in self._serials

    def __len__(self) -> int:
        return len(self._serials)

    def update(self, serials: Iterable[int], number: int) -> bool:
        """Take a revocation list numbered ``number`` if it is newer; returns whether it was taken."""
        with self._lock:
            if number <= self.number and self.number:
                return False
            self._serials, self.number = frozenset(serials), number
            return True


@dataclass(frozen=True)
class TlsCredentials:
    """One device's TLS identity: its contexts, the cluster certificate and the revocations it knows."""

    identity: PeerIdentity
    server_context: ssl.SSLContext
    client_context: ssl.SSLContext
    cluster_pem: bytes
    revocations: Revocations
    path: Path
    oscore: OscorePairwise | OscoreRoot | None = field(default=None, repr=False)
    """The OSCORE keys for ``coap://`` (None: the credential predates OSCORE)."""

    @classmethod
    def load(cls, path: str | os.PathLike) -> TlsCredentials:
        """Read a credential file; raises :class:`CredentialError` naming what is wrong."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise CredentialError(f"cannot read credential {path}: {error.strerror}") from None
        blocks = [(m.group(1).decode(), m.group(0)) for m in _PEM_BLOCK.finditer(data)]
        keys = [pem for kind, pem in blocks if kind.endswith("PRIVATE KEY")]
        certs = [pem for kind, pem in blocks if kind == "CERTIFICATE"]
        if len(keys) != 1 or len(certs) != 2:
            raise CredentialError(f"{path} is not an edgert credential (expected one private key and two "
                                  f"certificates, found {len(keys)} and {len(certs)}); create one with "
                                  f"'edgert keys enroll NAME'")
        if os.name == "posix" and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CredentialError(f"{path} is readable by other users; run 'chmod 600 {path}'")
        cluster_pem = certs[1]
        try:
            server = _context(ssl.PROTOCOL_TLS_SERVER, path, cluster_pem)
            client = _context(ssl.PROTOCOL_TLS_CLIENT, path, cluster_pem)
            own = x509.load_pem_x509_certificate(certs[0])
        except (ssl.SSLError, ValueError) as error:
            raise CredentialError(f"{path}: not a usable credential: {error}") from None
        identity = _identity_of_x509(own)
        if identity is None:
            raise CredentialError(f"{path}: the certificate names no edgert role (OU must be one of {ROLES})")
        return cls(identity=identity, server_context=server, client_context=client, cluster_pem=cluster_pem,
                   revocations=Revocations(), path=path, oscore=read_oscore(data, path))

    def check(self, identity: PeerIdentity | None) -> str | None:
        """Why ``identity`` may not talk to us (None: it may)."""
        if identity is None:
            return "no cluster credential presented (enrol the device: edgert keys enroll NAME)"
        if identity.serial in self.revocations:
            return f"the credential of {identity} is revoked"
        return None


def read_oscore(data: bytes, path: str | os.PathLike = "credential") -> OscorePairwise | OscoreRoot | None:
    """The OSCORE block of a credential file's bytes (None: it has none); raises :class:`CredentialError`."""
    blocks = [m.group(0) for m in _PEM_BLOCK.finditer(data) if m.group(1).decode() == OSCORE_LABEL]
    if not blocks:
        return None
    if len(blocks) > 1:
        raise CredentialError(f"{path} holds {len(blocks)} OSCORE blocks (expected one)")
    body = b"".join(blocks[0].splitlines()[1:-1])
    try:
        fields = cbor2.loads(base64.b64decode(body, validate=True))
        if not isinstance(fields, dict) or fields.get("v") != 1:
            raise ValueError("not a version 1 map")
        if "root" in fields:
            root = fields["root"]
            if not isinstance(root, bytes) or len(root) != 32:
                raise ValueError("the root secret must be 32 bytes")
            return OscoreRoot(root)
        name, role, serial = fields["peer"]
        context = OscorePairwise(
            secret=fields["secret"], salt=fields["salt"], id_context=fields["id_context"],
            sender_id=fields["sender_id"], recipient_id=fields["recipient_id"],
            peer=PeerIdentity(name=name, role=role, serial=serial), alg=fields["alg"])
        if not all(isinstance(value, bytes) for value in (context.secret, context.salt, context.id_context,
                                                           context.sender_id, context.recipient_id)):
            raise ValueError("secret, salt and ids must be byte strings")
        if len(context.secret) < 16 or len(context.id_context) > 255 or not isinstance(serial, int) \
                or role not in ROLES:
            raise ValueError("secret too short, ID context too long, or a bad peer role or serial")
        return context
    except (ValueError, TypeError, KeyError, cbor2.CBORDecodeError) as error:
        raise CredentialError(f"{path}: the OSCORE block is damaged ({error}); enrol the device again") from None


def _oscore_pem(fields: dict) -> bytes:
    body = base64.b64encode(cbor2.dumps(fields)).decode("ascii")
    lines = [body[i:i + 64] for i in range(0, len(body), 64)]
    return "\n".join([f"-----BEGIN {OSCORE_LABEL}-----", *lines, f"-----END {OSCORE_LABEL}-----", ""]).encode()


def credential_token(credential: bytes) -> str:
    """A credential file's bytes as one line (``edgert keys enroll --token``)."""
    return TOKEN_PREFIX + base64.urlsafe_b64encode(credential).decode("ascii")


def credential_from_token(token: str) -> bytes:
    """The credential file's bytes from :func:`credential_token` (``edgert keys import``)."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise CredentialError(f"not an edgert credential token (it must start with {TOKEN_PREFIX!r})")
    try:
        data = base64.urlsafe_b64decode(token[len(TOKEN_PREFIX):].encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise CredentialError("the credential token is damaged (not base64); copy it again") from None
    if b"PRIVATE KEY" not in data or data.count(b"BEGIN CERTIFICATE") != 2:
        raise CredentialError("the credential token does not hold a key and two certificates; copy it again")
    return data


def _context(protocol: int, credential: Path, cluster_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(credential)
    context.load_verify_locations(cadata=cluster_pem.decode("ascii"))
    context.check_hostname = False
    # A server lets a client without a certificate in, to answer it 4.01; a bad certificate fails the handshake.
    context.verify_mode = ssl.CERT_OPTIONAL if protocol == ssl.PROTOCOL_TLS_SERVER else ssl.CERT_REQUIRED
    context.set_alpn_protocols(["coap"])
    return context


def identity_of(certificate: dict | None) -> PeerIdentity | None:
    """The identity in a certificate as :meth:`ssl.SSLSocket.getpeercert` returns it (None: none or not ours)."""
    if not certificate:
        return None
    fields = {key: value for rdn in certificate.get("subject", ()) for key, value in rdn}
    name, role, serial = fields.get("commonName"), fields.get("organizationalUnitName"), certificate.get("serialNumber")
    if not name or role not in ROLES or not serial:
        return None
    return PeerIdentity(name=name, role=role, serial=int(serial, 16))


def _identity_of_x509(certificate: x509.Certificate) -> PeerIdentity | None:
    def first(oid: x509.ObjectIdentifier) -> str | None:
        values = certificate.subject.get_attributes_for_oid(oid)
        return str(values[0].value) if values else None

    name, role = first(NameOID.COMMON_NAME), first(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if not name or role not in ROLES:
        return None
    return PeerIdentity(name=name, role=role, serial=certificate.serial_number)


def peer_identity(transport) -> PeerIdentity | None:
    """The verified identity of the peer of an asyncio (TLS) transport; None if it presented none."""
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    return identity_of(ssl_object.getpeercert())


def write_private(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` readable by its owner only (mode 600, also when the file existed): keys, credentials."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


async def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether (host, port) completes a TLS handshake: a TLS server closes a plaintext CoAP
    connection without a byte, so only asking it in TLS tells it from a server that failed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # nothing is sent over it: the handshake is the whole question
    try:
        async with deadline.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port, ssl=context, server_hostname="")
    except (OSError, asyncio.TimeoutError):  # ssl.SSLError is an OSError
        return False
    writer.transport.abort()
    return True
