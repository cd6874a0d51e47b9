"""Admission of work on a worker: signed stage manifests, revocation lists, allowed graphs.

The coordinator signs every stage assignment (``PUT /stage``, ``POST /profile``) with the
cluster key; the signature covers the run id, the stage index and every meta field,
among them the manifest entry with each artifact's sha256, so a file that does not
match its hash is refused too (:func:`vet_stage_files`, before the worker writes or stops
anything). A worker with a credential admits a stage only if the signature verifies
against the cluster certificate in its credential; every worker loads a graph only if
:mod:`edgert.security.onnx_scan` finds nothing forbidden in it.
Signature format: docs/SECURITY.md, "Signed stages".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from edgert.errors import EdgertError
from edgert.protocol import CRL, SIGNATURE, StageAssignment
from edgert.security.errors import AdmissionRefused
from edgert.security.onnx_scan import scan_model
from edgert.transport import Envelope
from edgert.transport.tls import Revocations

SIGNATURE_DOMAIN = b"edgert stage assignment v1\x00"

Signer = Callable[[bytes], bytes]
"""``sign(data) -> signature`` by the cluster key (host side: :meth:`Keystore.sign`)."""


def signed_bytes(envelope: Envelope) -> bytes:
    """The canonical bytes a stage signature covers: kind, run id, stage and every meta field but the two."""
    meta = {key: value for key, value in envelope.meta.items() if key not in (SIGNATURE, CRL)}
    body = json.dumps([envelope.kind, envelope.run_id, envelope.stage, meta], sort_keys=True,
                      separators=(",", ":"), default=_not_json)
    return SIGNATURE_DOMAIN + body.encode("utf-8")


@dataclass(frozen=True)
class StageSigning:
    """What the coordinator signs stages with: the cluster key's ``sign`` and the current revocation list."""

    sign: Signer
    crl_pem: bytes | None = None

    def apply(self, envelope: Envelope) -> Envelope:
        """Add the signature (and the revocation list) to a stage envelope whose meta is final; in place."""
        envelope.meta[SIGNATURE] = self.sign(signed_bytes(envelope))
        if self.crl_pem is not None:
            envelope.meta[CRL] = self.crl_pem
        return envelope


class Admission:
    """A worker's gatekeeper: the cluster certificate it trusts and the revocations it knows."""

    def __init__(self, cluster_pem: bytes, revocations: Revocations) -> None:
        self._cluster = x509.load_pem_x509_certificate(cluster_pem)
        self._public_key = self._cluster.public_key()
        if not isinstance(self._public_key, ec.EllipticCurvePublicKey):
            raise ValueError("the cluster certificate must carry an EC key")
        self.revocations = revocations

    def check_assignment(self, envelope: Envelope) -> None:
        """Refuse an unsigned or wrongly signed stage; take a newer revocation list it carries."""
        signature = envelope.meta.get(SIGNATURE)
        if not isinstance(signature, (bytes, bytearray)):
            raise AdmissionRefused(f"stage {envelope.stage} of run {envelope.run_id!r} is not signed by the "
                                   f"cluster (no '{SIGNATURE}' in its meta)")
        try:
            self._public_key.verify(bytes(signature), signed_bytes(envelope), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError):
            raise AdmissionRefused(f"stage {envelope.stage} of run {envelope.run_id!r}: the manifest signature "
                                   f"does not verify against the cluster certificate (tampered, or signed by "
                                   f"another cluster)") from None
        crl = envelope.meta.get(CRL)
        if crl is not None:
            self.take_crl(crl)

    def take_crl(self, crl_pem: bytes | bytearray | str) -> bool:
        """Apply a revocation list signed by the cluster if it is newer than the one held."""
        data = crl_pem.encode() if isinstance(crl_pem, str) else bytes(crl_pem)
        try:
            crl = x509.load_pem_x509_crl(data)
        except ValueError as error:
            raise AdmissionRefused(f"revocation list is not a PEM CRL: {error}") from None
        if crl.issuer != self._cluster.subject or not crl.is_signature_valid(self._public_key):
            raise AdmissionRefused("revocation list is not signed by this cluster")
        number_ext = crl.extensions.get_extension_for_class(x509.CRLNumber)
        return self.revocations.update((r.serial_number for r in crl), number_ext.value.crl_number)


def vet_stage_files(assignment: StageAssignment, files: dict[str, bytes]) -> None:
    """Refuse, before anything is written or stopped, a stage whose files are missing, do not match
    the manifest's sha256, or hold a graph with a forbidden op domain or external data."""
    entry = assignment.entry
    missing = [role for role in assignment.roles if role not in files]
    if missing:
        raise EdgertError(f"artifact(s) {', '.join(missing)} missing from the assignment")
    for artifact in assignment.artifacts:
        what = f"stage {entry.index} {artifact.role}"
        actual = hashlib.sha256(files[artifact.role]).hexdigest()
        if actual != artifact.sha256:
            raise EdgertError(f"{what}: {artifact.path.rsplit('/', 1)[-1]} does not match the manifest "
                              f"(sha256 {actual[:12]}..., expected {artifact.sha256[:12]}...)")
        if artifact.path.endswith(".onnx"):
            scan_model(files[artifact.role]).check(what)


def _not_json(value: object) -> object:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"meta value of type {type(value).__name__} cannot be signed")
