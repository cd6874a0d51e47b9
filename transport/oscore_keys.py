"""OSCORE keys and state for ``coap://``: pairwise contexts from enrolment, persistent sequence numbers.

* **Keys.** Every worker credential holds a static pairwise context with the coordinator
  (:class:`~edgert.transport.tls.OscorePairwise`); the coordinator's credential holds the
  root secret they derive from (:func:`device_context`), so the coordinator finds a
  device's context from the ID Context in its requests (``CBOR [name, role, serial]``),
  checked against the keystore's ``devices.json`` and the revocation list.
* **State.** Sequence numbers and replay windows live in ``CREDENTIAL.oscore/`` next to the
  credential file, one folder per peer, with aiocoap's :class:`FilesystemSecurityContext`
  logic (sequence numbers reserved ahead in growing chunks and fsync'd before use, so a
  restart never reuses one; a replay window saved at shutdown, or, after a crash,
  re-established with the Echo option of Appendix B.1.2). A lock file keeps a second
  process off the same state.

The client and server that use these contexts are in :mod:`edgert.transport.oscore`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import threading
from pathlib import Path

import cbor2
import filelock
from aiocoap import oscore
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edgert.transport.errors import CredentialError, OscoreRefused
from edgert.transport.tls import (
    ROLES,
    OscorePairwise,
    OscoreRoot,
    PeerIdentity,
    TlsCredentials,
)

log = logging.getLogger("edgert.transport.oscore")

#: Sender IDs inside every pairwise context (the ID Context tells the devices apart).
DEVICE_ID, COORDINATOR_ID = b"\x01", b"\x00"
ALGORITHM = "AES-CCM-16-64-128"
_KDF_SALT = b"edgert oscore v1"


# -- keys ----------------------------------------------------------------------------------


def id_context(device: PeerIdentity) -> bytes:
    """The OSCORE ID Context of a device's pairwise context: CBOR ``[name, role, serial]``."""
    return cbor2.dumps([device.name, device.role, device.serial])


def device_context(root: bytes, device: PeerIdentity, coordinator: PeerIdentity) -> OscorePairwise:
    """A device's pairwise context with the coordinator, derived from the coordinator's root secret.

    Master Secret (32 bytes) || Master Salt (8 bytes) = HKDF-SHA-256(salt="edgert oscore v1",
    IKM=root, info=ID Context). A new enrolment has a new serial, so new keys: the contexts of a
    revoked credential never come back.
    """
    context = id_context(device)
    derived = HKDF(algorithm=hashes.SHA256(), length=40, salt=_KDF_SALT, info=context).derive(root)
    return OscorePairwise(secret=derived[:32], salt=derived[32:], id_context=context, sender_id=DEVICE_ID,
                          recipient_id=COORDINATOR_ID, peer=coordinator, alg=ALGORITHM)


def state_dir(credential: Path) -> Path:
    """Where the OSCORE state of a credential lives: ``CREDENTIAL.oscore/`` beside it."""
    return credential.with_name(credential.name + ".oscore")


class StoredContext(oscore.FilesystemSecurityContext):
    """One pairwise OSCORE context whose sequence numbers and replay window persist in ``basedir``.

    aiocoap's :class:`~aiocoap.oscore.FilesystemSecurityContext` (``sequence.json``, the lock, the
    B.1.1 chunked sequence numbers, B.1.2 Echo recovery) with the keys from a credential instead of
    ``secret.json``. ``lock`` serialises protect/unprotect between threads of one process.
    """

    def __init__(self, basedir: Path, keys: OscorePairwise, *, own_id: bytes, peer_id: bytes,
                 peer: PeerIdentity) -> None:
        self.lockfile = None
        try:
            basedir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            raise CredentialError(f"cannot keep the OSCORE state in {basedir}: {error.strerror}") from None
        self.basedir = str(basedir)
        self.peer = peer
        self.lock = threading.Lock()
        self._keys, self._own_id, self._peer_id = keys, own_id, peer_id
        lockfile = filelock.FileLock(str(basedir / "lock"), thread_local=False)
        try:
            lockfile.acquire(timeout=0)
        except filelock.Timeout:
            raise CredentialError(f"the OSCORE state {basedir} is in use by another process (one credential "
                                  f"per running process)") from None
        except OSError as error:
            raise CredentialError(f"cannot lock the OSCORE state in {basedir}: {error}") from None
        self.lockfile = lockfile
        self.echo_recovery = secrets.token_bytes(8)
        try:
            self._load()
        except BaseException:
            self.lockfile.release()
            self.lockfile = None
            raise
        self.sequence_number_chunksize_start = 10
        self.sequence_number_chunksize_limit = 10000
        self.sequence_number_chunksize = 10
        self.sequence_number_persisted = self.sender_sequence_number

    def _load(self) -> None:
        keys = self._keys
        self.alg_aead = oscore.algorithms[keys.alg]
        self.hashfun = oscore.hashfunctions["sha256"]
        self.sender_id, self.recipient_id, self.id_context = self._own_id, self._peer_id, keys.id_context
        self.derive_keys(keys.salt, keys.secret)
        self.recipient_replay_window = oscore.ReplayWindow(oscore.DEFAULT_WINDOWSIZE, self._replay_window_changed)
        try:
            sequence = json.loads(Path(self.basedir, "sequence.json").read_text())
        except FileNotFoundError:
            self.sender_sequence_number = 0
            self.recipient_replay_window.initialize_empty()
            self.replay_window_persisted = True
            return
        except (OSError, ValueError) as error:
            raise CredentialError(f"{self.basedir}/sequence.json is unreadable ({error}); the OSCORE state is "
                                  f"lost: revoke and enrol the device again") from None
        self.sender_sequence_number = int(sequence["next-to-send"])
        received = sequence["received"]
        if received == "unknown":  # not shut down cleanly: the window is rebuilt with Echo (B.1.2)
            self.replay_window_persisted = False
        else:
            self.recipient_replay_window.initialize_from_persisted(received)
            self.replay_window_persisted = True

    def close(self) -> None:
        """Save the sequence number and replay window, release the lock; the context is unusable afterwards.

        If the state cannot be saved, what is on disk is still safe: a sequence number ahead of every one
        used, and the replay window marked unknown (the next start recovers it with Echo).
        """
        with self.lock:
            if self.lockfile is None:
                return
            try:
                self.replay_window_persisted = True
                self.sequence_number_persisted = self.sender_sequence_number
                self._store()
            except OSError as error:
                log.warning("could not save the OSCORE state in %s (%s); the next start recovers", self.basedir,
                            error)
            finally:
                for name in ("sender_key", "recipient_key"):
                    self.__dict__.pop(name, None)
                try:
                    os.unlink(self.lockfile.lock_file)
                except OSError:
                    pass
                self.lockfile.release()
                self.lockfile = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __repr__(self) -> str:
        return f"<OSCORE context with {self.peer} in {self.basedir}>"


class _Registry:
    """The contexts open in this process, by state folder, shared by every server and client using them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Path, list] = {}

    def acquire(self, basedir: Path, factory) -> StoredContext:
        with self._lock:
            entry = self._open.get(basedir)
            if entry is None:
                entry = self._open[basedir] = [factory(), 0]
            entry[1] += 1
            return entry[0]

    def release(self, context: StoredContext) -> None:
        basedir = Path(context.basedir)
        with self._lock:
            entry = self._open.get(basedir)
            if entry is None or entry[0] is not context:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._open[basedir]
        context.close()


_REGISTRY = _Registry()


class _Devices:
    """The enrolments in the keystore's ``devices.json`` (beside the coordinator's credential), re-read on change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: float | None = None
        self._entries: list[dict] = []

    def entries(self) -> list[dict]:
        try:
            stamp = self.path.stat().st_mtime_ns
        except OSError:
            raise CredentialError(f"no device registry at {self.path} (the coordinator's credential must stay "
                                  f"in its keystore folder)") from None
        if stamp != self._stamp:
            try:
                self._entries = list(json.loads(self.path.read_text())["enrolments"])
            except (OSError, ValueError, KeyError) as error:
                raise CredentialError(f"the device registry {self.path} is unreadable: {error}") from None
            self._stamp = stamp
        return self._entries

    def find(self, name: str, serial: int | None = None) -> dict | None:
        """The enrolment of ``name`` with ``serial``; without a serial the live one."""
        matches = [e for e in self.entries() if e.get("name") == name
                   and (e.get("serial") == serial if serial is not None else e.get("revoked") is None)]
        return matches[-1] if matches else None


class OscoreKeys:
    """The OSCORE contexts one server or client uses, from its credential; :meth:`close` releases them."""

    def __init__(self, tls: TlsCredentials) -> None:
        if tls.oscore is None:
            raise CredentialError(f"{tls.path} holds no OSCORE keys (enrolled before coap:// was protected): "
                                  f"enrol the device again, or use coaps+tcp://")
        self.tls = tls
        self.material = tls.oscore
        self.state = state_dir(tls.path)
        self._held: dict[Path, StoredContext] = {}
        self._lock = threading.Lock()
        self._devices = _Devices(tls.path.parent / "devices.json") if isinstance(tls.oscore, OscoreRoot) else None

    # -- choosing a context ------------------------------------------------------------

    def for_peer(self, name: str | None) -> StoredContext:
        """The context a client protects a request with (``name``: the device, for the coordinator)."""
        if isinstance(self.material, OscorePairwise):
            return self._device_side()
        if not name:
            raise CredentialError("the coordinator reaches a device over coap:// by name: coap://NAME@host:port")
        entry = self._devices.find(name)
        if entry is None:
            raise CredentialError(f"no live enrolment named {name!r} in {self._devices.path}")
        device = PeerIdentity(name=name, role=entry["role"], serial=int(entry["serial"]))
        reason = self.tls.check(device) or _expired(entry, device)
        if reason is not None:
            raise CredentialError(reason)
        return self._coordinator_side(device)

    def for_request(self, unprotected: dict) -> StoredContext:
        """The context of an incoming request (its kid and kid context); raises :class:`OscoreRefused`."""
        kid = unprotected.get(oscore.COSE_KID)
        kid_context = unprotected.get(oscore.COSE_KID_CONTEXT)
        if isinstance(self.material, OscorePairwise):
            if kid != self.material.recipient_id or kid_context != self.material.id_context:
                raise OscoreRefused("no OSCORE context for this sender: a worker takes OSCORE requests from its "
                                    "cluster's coordinator only")
            context = self._device_side()
        else:
            if kid != DEVICE_ID or not kid_context:
                raise OscoreRefused("no OSCORE context for this sender (not an enrolled device of this cluster)")
            device = _device_of(kid_context)
            try:
                entry = self._devices.find(device.name, device.serial)
            except CredentialError as error:
                log.warning("cannot check an OSCORE request: %s", error)
                raise OscoreRefused("the coordinator cannot check devices right now (no device registry)") from None
            if entry is None or entry.get("role") != device.role:
                raise OscoreRefused(f"{device} is not enrolled in this cluster")
            if entry.get("revoked"):  # the registry knows even before a revocation list is loaded
                raise OscoreRefused(f"the credential of {device} is revoked")
            reason = self.tls.check(device) or _expired(entry, device)
            if reason is not None:
                raise OscoreRefused(reason)
            context = self._coordinator_side(device)
        reason = self.tls.check(context.peer)
        if reason is not None:
            raise OscoreRefused(reason)
        return context

    def prepare(self) -> None:
        """Open a device's context now, so that a locked or unwritable state fails at start, not later."""
        if isinstance(self.material, OscorePairwise):
            self._device_side()

    def _device_side(self) -> StoredContext:
        material = self.material
        return self._context(self.state / _folder(material.peer), lambda basedir: StoredContext(
            basedir, material, own_id=material.sender_id, peer_id=material.recipient_id, peer=material.peer))

    def _coordinator_side(self, device: PeerIdentity) -> StoredContext:
        def open_context(basedir: Path) -> StoredContext:
            keys = device_context(self.material.root, device, self.tls.identity)
            return StoredContext(basedir, keys, own_id=keys.recipient_id, peer_id=keys.sender_id, peer=device)

        return self._context(self.state / _folder(device), open_context)

    def _context(self, basedir: Path, factory) -> StoredContext:
        with self._lock:
            context = self._held.get(basedir)
            if context is None:
                try:
                    self.state.mkdir(mode=0o700, parents=True, exist_ok=True)
                    os.chmod(self.state, 0o700)
                except OSError as error:
                    raise CredentialError(f"cannot keep the OSCORE state in {self.state}: {error.strerror}") from None
                context = self._held[basedir] = _REGISTRY.acquire(basedir, lambda: factory(basedir))
            return context

    def close(self) -> None:
        """Release every context (the last user in the process saves its state)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for context in held:
            _REGISTRY.release(context)


def _folder(peer: PeerIdentity) -> str:
    return f"{peer.name}-{peer.serial:x}"


def _device_of(kid_context: bytes) -> PeerIdentity:
    try:
        name, role, serial = cbor2.loads(kid_context)
    except Exception:  # noqa: BLE001  (any malformed CBOR from the network)
        raise OscoreRefused("the OSCORE ID Context names no device") from None
    if not isinstance(name, str) or role not in ROLES or not isinstance(serial, int) or isinstance(serial, bool):
        raise OscoreRefused("the OSCORE ID Context names no device")
    device = PeerIdentity(name=name, role=role, serial=serial)
    if id_context(device) != kid_context:
        raise OscoreRefused("the OSCORE ID Context is not in canonical form")
    return device


def _expired(entry: dict, device: PeerIdentity) -> str | None:
    try:
        expires = datetime.datetime.fromisoformat(entry["expires"])
    except (KeyError, TypeError, ValueError):
        return None
    if expires < datetime.datetime.now(datetime.timezone.utc):
        return f"the credential of {device} expired on {entry['expires']}"
    return None


__all__ = ["ALGORITHM", "COORDINATOR_ID", "DEVICE_ID", "OscoreKeys", "StoredContext",
           "device_context", "id_context", "state_dir"]
