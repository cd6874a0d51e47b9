"""A throw-away cluster identity per test session: the keystore, worker credentials, a stranger's."""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgert.security.keystore import Keystore, local_cluster_keys
from edgert.transport.tls import TlsCredentials
from tests.zoo_plans import zoo_plan


@dataclass
class Cluster:
    keys: Path  # the keystore folder
    store: Keystore
    workers: list[Path]  # credential files of w0..w3
    revoked: Path  # credential of a device that was enrolled and then revoked
    stranger: Path  # credential of another cluster's device

    def tls(self, path: Path) -> TlsCredentials:
        """Fresh credentials (each with its own revocation set) from a file."""
        return TlsCredentials.load(path)

    @property
    def coordinator(self) -> TlsCredentials:
        return TlsCredentials.load(self.store.coordinator_credential)

    def anonymous(self) -> TlsCredentials:
        """Credentials that trust the cluster but present no certificate of their own."""
        tls = self.tls(self.workers[0])
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.load_verify_locations(cadata=tls.cluster_pem.decode())
        return dataclasses.replace(tls, client_context=context)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    folder = tmp_path_factory.mktemp("cluster")
    workers = local_cluster_keys(folder, ["w0", "w1", "w2", "w3", "gone"], cluster="test")
    store = Keystore.open(folder / "cluster")
    store.revoke("gone")
    (stranger,) = local_cluster_keys(folder / "other", ["stranger"], cluster="other")
    return Cluster(keys=folder / "cluster", store=store, workers=workers[:4], revoked=workers[4],
                   stranger=stranger)


@pytest.fixture(scope="session")
def mlp_plan3(tmp_path_factory) -> Path:
    """The zoo's mlp exported into 3 stages (default training settings)."""
    return zoo_plan(tmp_path_factory.mktemp("mlp-plan3"), 3)
