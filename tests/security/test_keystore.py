"""The cluster identity: init, enrol, revoke, tokens, and the CLI that wraps them."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner
from cryptography import x509

from edgert.cli import main
from edgert.security.errors import KeystoreError
from edgert.security.keystore import Keystore
from edgert.transport.errors import CredentialError
from edgert.transport.tls import TlsCredentials, credential_from_token, credential_token


def test_enrolled_credential_names_the_device_and_is_private(tmp_path):
    store = Keystore.init(tmp_path / "keys", cluster="c1")
    assert stat.S_IMODE(os.stat(tmp_path / "keys" / "cluster.key").st_mode) == 0o600
    path = tmp_path / "pi.pem"
    path.touch(mode=0o600)
    path.write_bytes(store.enroll("pi-1"))
    tls = TlsCredentials.load(path)
    assert (tls.identity.name, tls.identity.role) == ("pi-1", "worker")
    assert TlsCredentials.load(store.coordinator_credential).identity.role == "coordinator"
    assert [e.name for e in Keystore.open(tmp_path / "keys").enrolments] == ["coordinator", "pi-1"]


def test_enrolment_mistakes_are_clear_errors(tmp_path):
    store = Keystore.init(tmp_path / "keys")
    store.enroll("pi-1")
    with pytest.raises(KeystoreError, match="already enrolled"):
        store.enroll("pi-1")
    with pytest.raises(KeystoreError, match="device name"):
        store.enroll("../etc")
    with pytest.raises(KeystoreError, match="no live enrolment named 'pi-9'"):
        store.revoke("pi-9")
    with pytest.raises(KeystoreError, match="already holds a cluster identity"):
        Keystore.init(tmp_path / "keys")
    with pytest.raises(KeystoreError, match="edgert keys init"):
        Keystore.open(tmp_path / "nowhere")


def test_revoking_lists_the_serial_in_a_newer_signed_crl(tmp_path):
    store = Keystore.init(tmp_path / "keys")
    store.enroll("pi-1")
    before = store.crl_number
    (serial,) = store.revoke("pi-1")
    crl = x509.load_pem_x509_crl(store.crl_pem)
    assert crl.is_signature_valid(store.certificate.public_key())
    assert [r.serial_number for r in crl] == [serial]
    assert store.crl_number == before + 1
    store.enroll("pi-1")  # a revoked name may be enrolled again, with a new certificate


def test_credential_file_checks(tmp_path, cluster):
    loose = tmp_path / "loose.pem"
    loose.write_bytes(cluster.workers[0].read_bytes())
    os.chmod(loose, 0o644)
    with pytest.raises(CredentialError, match="chmod 600"):
        TlsCredentials.load(loose)
    garbage = tmp_path / "garbage.pem"
    garbage.touch(mode=0o600)
    garbage.write_bytes(b"not a credential")
    with pytest.raises(CredentialError, match="not an edgert credential"):
        TlsCredentials.load(garbage)
    with pytest.raises(CredentialError, match="cannot read"):
        TlsCredentials.load(tmp_path / "missing.pem")


def test_token_round_trip_and_damage():
    data = b"# x\n-----BEGIN PRIVATE KEY-----\n-----BEGIN CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\n"
    assert credential_from_token(credential_token(data)) == data
    with pytest.raises(CredentialError, match="must start with"):
        credential_from_token("hello")
    with pytest.raises(CredentialError, match="does not hold"):
        credential_from_token(credential_token(b"nothing"))


def test_cli_init_enroll_token_import_revoke_list(tmp_path):
    runner = CliRunner()
    keys = str(tmp_path / "keys")
    assert runner.invoke(main, ["keys", "init", "--keys", keys, "--cluster", "lab"]).exit_code == 0
    token = runner.invoke(main, ["keys", "enroll", "pi-1", "--keys", keys, "--token"])
    assert token.exit_code == 0, token.output
    line = next(x for x in token.stdout.splitlines() if x.startswith("edgert-credential:"))
    out = tmp_path / "board.pem"
    imported = runner.invoke(main, ["keys", "import", line, "-o", str(out)])
    assert imported.exit_code == 0, imported.output
    assert "worker 'pi-1'" in imported.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    listed = runner.invoke(main, ["keys", "list", "--keys", keys])
    assert "pi-1" in listed.output and "PRIVATE" not in listed.output
    assert runner.invoke(main, ["keys", "revoke", "pi-1", "--keys", keys]).exit_code == 0
    assert "revoked" in runner.invoke(main, ["keys", "list", "--keys", keys]).output


def test_commands_without_credentials_ask_for_them_or_insecure(tmp_path, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(main, ["worker", "--listen", "coap+tcp://127.0.0.1:0"])
    assert result.exit_code == 2 and "--credential FILE" in result.output and "--insecure" in result.output
    monkeypatch.setenv("HOME", str(tmp_path))
    plan = tmp_path / "plan"
    plan.mkdir()
    result = runner.invoke(main, ["train", str(plan), "--workers", "coaps+tcp://127.0.0.1:1",
                                  "--keys", str(tmp_path / "none")])
    assert result.exit_code == 2 and "edgert keys init" in result.output
