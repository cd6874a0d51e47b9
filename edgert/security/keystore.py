"""The cluster identity on the host: a signing CA, the enrolled devices, and the revocation list.

``edgert keys init`` creates a keystore folder (docs/SECURITY.md, "Keystore")::

    cluster.key      the cluster's private key (EC P-256, mode 600): signs certificates, CRLs, stages
    cluster.pem      the cluster certificate (a CA): the only trust anchor a device needs
    coordinator.pem  the coordinator's own credential (role coordinator), with the OSCORE root secret
    devices.json     every enrolled certificate: name, role, serial, dates, revoked or not
    crl.pem          the signed revocation list, renumbered on every revoke

Devices get credentials from :meth:`Keystore.enroll` (see :mod:`edgert.transport.tls` for the
format), including their OSCORE context with the coordinator, derived from the root secret
(:func:`edgert.transport.oscore_keys.device_context`); the coordinator signs every stage it hands
out with :meth:`Keystore.sign`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from edgert.security.admission import Admission, StageSigning
from edgert.security.errors import KeystoreError
from edgert.transport.oscore_keys import device_context
from edgert.transport.tls import (
    COORDINATOR_ROLE,
    ROLES,
    OscoreRoot,
    PeerIdentity,
    TlsCredentials,
    read_oscore,
    write_private,
)

DEFAULT_DIR = Path(os.environ.get("EDGERT_KEYS", Path.home() / ".edgert" / "cluster"))
CREDENTIAL_DAYS = 365
CLUSTER_DAYS = 3650
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class HostSecurity:
    """What the host's commands (train, profile) talk and sign with: the coordinator's credential, the key."""

    tls: TlsCredentials
    signing: StageSigning

    @classmethod
    def open(cls, folder: str | os.PathLike = DEFAULT_DIR) -> HostSecurity:
        """Load the keystore in ``folder``; the coordinator then refuses revoked devices too."""
        store = Keystore.open(folder)
        tls = TlsCredentials.load(store.coordinator_credential)
        crl = store.crl_pem
        Admission(tls.cluster_pem, tls.revocations).take_crl(crl)
        return cls(tls=tls, signing=StageSigning(store.sign, crl))


@dataclass
class Enrolment:
    """One certificate the cluster issued (``devices.json``)."""

    name: str
    role: str
    serial: int
    enrolled: str
    expires: str
    revoked: str | None = None


class Keystore:
    """A keystore folder; open with :meth:`open`, create with :meth:`init`."""

    def __init__(self, folder: Path, key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate,
                 enrolments: list[Enrolment], crl_number: int) -> None:
        self.folder = folder
        self._key = key
        self.certificate = certificate
        self.enrolments = enrolments
        self.crl_number = crl_number
        self._oscore_root: bytes | None = None

    # -- creating and opening ----------------------------------------------------------

    @classmethod
    def init(cls, folder: str | os.PathLike = DEFAULT_DIR, cluster: str = "edgert") -> Keystore:
        """Create a cluster identity in ``folder`` (which must not hold one) and enrol the coordinator."""
        folder = Path(folder)
        if (folder / "cluster.key").exists():
            raise KeystoreError(f"{folder} already holds a cluster identity; use it, or choose another folder")
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"{cluster} cluster")])
        now = _now()
        certificate = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CLUSTER_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256())
        )
        write_private(folder / "cluster.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (folder / "cluster.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        store = cls(folder, key, certificate, [], 0)
        store._oscore_root = secrets.token_bytes(32)
        write_private(folder / "coordinator.pem", store.enroll("coordinator", role="coordinator"))
        store._write_crl()
        return store

    @classmethod
    def open(cls, folder: str | os.PathLike = DEFAULT_DIR) -> Keystore:
        """Open an existing keystore; a missing one is an error that says how to create it."""
        folder = Path(folder)
        try:
            key = serialization.load_pem_private_key((folder / "cluster.key").read_bytes(), password=None)
            certificate = x509.load_pem_x509_certificate((folder / "cluster.pem").read_bytes())
        except FileNotFoundError:
            raise KeystoreError(f"no cluster identity in {folder}; create one with 'edgert keys init "
                                f"--keys {folder}'") from None
        except ValueError as error:
            raise KeystoreError(f"{folder}: the cluster key or certificate is damaged: {error}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise KeystoreError(f"{folder}/cluster.key is not an EC key")
        enrolments, crl_number = [], 0
        registry = folder / "devices.json"
        if registry.exists():
            data = json.loads(registry.read_text())
            enrolments = [Enrolment(**item) for item in data["enrolments"]]
            crl_number = int(data.get("crl_number", 0))
        return cls(folder, key, certificate, enrolments, crl_number)

    # -- devices -------------------------------------------------------------------------

    def enroll(self, name: str, role: str = "worker", days: int = CREDENTIAL_DAYS) -> bytes:
        """Issue a credential for ``name`` (PEM: key, certificate, cluster certificate) and record it."""
        if not _NAME.match(name):
            raise KeystoreError(f"device name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        if role not in ROLES:
            raise KeystoreError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if any(e.name == name and e.revoked is None for e in self.enrolments):
            raise KeystoreError(f"{name!r} is already enrolled; revoke it first ('edgert keys revoke {name}')")
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, self.cluster),
                                     x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                                     x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.certificate.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.CLIENT_AUTH,
                                                  x509.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        root = self._root()
        if role == COORDINATOR_ROLE:
            # Only the keystore's own coordinator holds the root: two holders would derive the same device
            # keys with separate sequence numbers (nonce reuse). Other coordinator credentials use coaps+tcp.
            oscore = OscoreRoot(root).to_pem() if name == "coordinator" else b""
        else:
            device = PeerIdentity(name=name, role=role, serial=certificate.serial_number)
            oscore = device_context(root, device, self._coordinator_identity()).to_pem()
        self.enrolments.append(Enrolment(name=name, role=role, serial=certificate.serial_number,
                                         enrolled=now.isoformat(timespec="seconds"),
                                         expires=certificate.not_valid_after_utc.isoformat(timespec="seconds")))
        self._save()
        return (f"# edgert credential name={name} role={role}\n".encode()
                + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
                + certificate.public_bytes(serialization.Encoding.PEM)
                + self.certificate.public_bytes(serialization.Encoding.PEM)
                + oscore)

    def _root(self) -> bytes:
        """The OSCORE root secret (kept in coordinator.pem; added to a keystore made before OSCORE)."""
        if self._oscore_root is None:
            path = self.coordinator_credential
            data = path.read_bytes()
            block = read_oscore(data, path)
            if isinstance(block, OscoreRoot):
                self._oscore_root = block.root
            else:
                self._oscore_root = secrets.token_bytes(32)
                write_private(path, data + OscoreRoot(self._oscore_root).to_pem())
        return self._oscore_root

    def _coordinator_identity(self) -> PeerIdentity:
        """Who a device's OSCORE peer is: the live credential named 'coordinator'."""
        for enrolment in reversed(self.enrolments):
            if enrolment.name == "coordinator" and enrolment.role == COORDINATOR_ROLE and enrolment.revoked is None:
                return PeerIdentity(name=enrolment.name, role=enrolment.role, serial=enrolment.serial)
        raise KeystoreError(f"{self.folder} has no live coordinator credential")

    def revoke(self, name: str) -> list[int]:
        """Revoke every live certificate of ``name``; returns their serials and re-signs the CRL."""
        revoked = [e for e in self.enrolments if e.name == name and e.revoked is None]
        if not revoked:
            known = sorted({e.name for e in self.enrolments if e.revoked is None})
            raise KeystoreError(f"no live enrolment named {name!r} (enrolled: {', '.join(known) or 'none'})")
        stamp = _now().isoformat(timespec="seconds")
        for enrolment in revoked:
            enrolment.revoked = stamp
        self._write_crl()
        return [e.serial for e in revoked]

    # -- what the coordinator uses ---------------------------------------------------------

    @property
    def cluster(self) -> str:
        """The cluster's name (the O of every certificate)."""
        return str(self.certificate.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value)

    @property
    def coordinator_credential(self) -> Path:
        """The coordinator's credential file."""
        return self.folder / "coordinator.pem"

    @property
    def crl_pem(self) -> bytes:
        """The current signed revocation list."""
        return (self.folder / "crl.pem").read_bytes()

    def sign(self, data: bytes) -> bytes:
        """ECDSA P-256 / SHA-256 signature of ``data`` by the cluster key (verified with cluster.pem)."""
        return self._key.sign(data, ec.ECDSA(hashes.SHA256()))

    def _write_crl(self) -> None:
        self.crl_number += 1
        now = _now()
        builder = (x509.CertificateRevocationListBuilder().issuer_name(self.certificate.subject)
                   .last_update(now).next_update(now + datetime.timedelta(days=CLUSTER_DAYS))
                   .add_extension(x509.CRLNumber(self.crl_number), critical=False))
        for enrolment in self.enrolments:
            if enrolment.revoked is not None:
                builder = builder.add_revoked_certificate(
                    x509.RevokedCertificateBuilder().serial_number(enrolment.serial)
                    .revocation_date(datetime.datetime.fromisoformat(enrolment.revoked)).build())
        crl = builder.sign(self._key, hashes.SHA256())
        (self.folder / "crl.pem").write_bytes(crl.public_bytes(serialization.Encoding.PEM))
        self._save()

    def _save(self) -> None:
        data = {"cluster": self.cluster, "crl_number": self.crl_number,
                "enrolments": [asdict(e) for e in self.enrolments]}
        (self.folder / "devices.json").write_text(json.dumps(data, indent=2) + "\n")


def local_cluster_keys(folder: Path, names: list[str], cluster: str = "local") -> list[Path]:
    """A throw-away cluster in ``folder/cluster`` and one credential file per name (demo, tests, benchmarks)."""
    store = Keystore.init(folder / "cluster", cluster=cluster)
    paths = []
    for name in names:
        path = folder / f"{name}.pem"
        write_private(path, store.enroll(name))
        paths.append(path)
    return paths


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
