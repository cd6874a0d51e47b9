"""``edgert keys init|enroll|revoke|list`` (host) and ``edgert keys import`` (board), plus the
security options every networked command shares (``--keys``/``--credential``, ``--insecure``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from edgert.errors import EdgertError
from edgert.transport.tls import write_private

INSECURE_WARNING = ("WARNING: --insecure: plaintext CoAP without authentication. Anyone who can reach "
                    "{what} can read its traffic and send it commands, stages and tensors.")


def _default_keys() -> Path:
    from edgert.security.keystore import DEFAULT_DIR

    return DEFAULT_DIR


_keystore_option = click.option("--keys", "folder", type=click.Path(file_okay=False, path_type=Path), default=None,
                                help="Keystore folder (default $EDGERT_KEYS or ~/.edgert/cluster).")


@click.group("keys")
def keys_group() -> None:
    pass  # its help is its line in edgert.cli.COMMANDS


@keys_group.command("init")
@_keystore_option
@click.option("--cluster", default="edgert", show_default=True, help="The cluster's name (in every certificate).")
def init_command(folder: Path | None, cluster: str) -> None:
    """Create the cluster identity (a signing CA) and the coordinator's credential."""
    from edgert.security.keystore import Keystore

    store = Keystore.init(folder or _default_keys(), cluster)
    click.echo(f"created cluster {store.cluster!r} in {store.folder} (keep cluster.key secret; "
               f"enrol devices with: edgert keys enroll NAME)")


@keys_group.command("enroll")
@click.argument("name")
@_keystore_option
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Credential file to write (default NAME.pem); copy it onto the board.")
@click.option("--token", is_flag=True, help="Print the credential as one line instead (for 'edgert keys import').")
@click.option("--days", type=int, default=365, show_default=True, help="Validity of the credential.")
def enroll_command(name: str, folder: Path | None, out_path: Path | None, token: bool, days: int) -> None:
    """Issue device NAME a credential signed by the cluster."""
    from edgert.security.keystore import Keystore
    from edgert.transport.tls import credential_token

    credential = Keystore.open(folder or _default_keys()).enroll(name, days=days)
    if token:
        click.echo(credential_token(credential))
        click.echo(f"enrolled {name}; on the board: edgert keys import TOKEN -o {name}.pem", err=True)
        return
    path = out_path or Path(f"{name}.pem")
    write_private(path, credential)
    click.echo(f"enrolled {name}: wrote {path}; on the board: edgert worker --credential {path.name}")


@keys_group.command("revoke")
@click.argument("name")
@_keystore_option
def revoke_command(name: str, folder: Path | None) -> None:
    """Revoke device NAME: the coordinator refuses it at once, workers with the next stage they load."""
    from edgert.security.keystore import Keystore

    store = Keystore.open(folder or _default_keys())
    serials = store.revoke(name)
    click.echo(f"revoked {name} ({len(serials)} credential(s)); revocation list #{store.crl_number}")


@keys_group.command("list")
@_keystore_option
def list_command(folder: Path | None) -> None:
    """The enrolled devices (never their keys)."""
    from edgert.security.keystore import Keystore

    store = Keystore.open(folder or _default_keys())
    click.echo(f"cluster {store.cluster!r} in {store.folder}")
    for e in store.enrolments:
        state = f"revoked {e.revoked}" if e.revoked else f"valid until {e.expires}"
        click.echo(f"  {e.name:<20} {e.role:<12} serial {e.serial:x}  {state}")


@keys_group.command("import")
@click.argument("token")
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Credential file to write (mode 600).")
def import_command(token: str, out_path: Path) -> None:
    """On a board: write the credential file from a token printed by 'edgert keys enroll --token' ('-' = stdin)."""
    from edgert.transport.tls import TlsCredentials, credential_from_token

    write_private(out_path, credential_from_token(sys.stdin.read() if token == "-" else token))
    identity = TlsCredentials.load(out_path).identity
    click.echo(f"wrote {out_path}: {identity}")


def worker_credentials(credential: Path | None, insecure: bool):
    """The worker's :class:`TlsCredentials`, or None after the warning when ``--insecure``."""
    from edgert.transport.tls import TlsCredentials

    if insecure:
        if credential is not None:
            raise click.UsageError("give --credential or --insecure, not both")
        click.echo(INSECURE_WARNING.format(what="this worker"), err=True)
        return None
    if credential is None:
        raise click.UsageError("no credential: pass --credential FILE (from 'edgert keys enroll NAME' on the host) "
                               "or --insecure for plaintext CoAP")
    return TlsCredentials.load(credential)


def host_keys(keys: Path | None, insecure: bool) -> Path | None:
    """The keystore folder a host command uses, or None after the warning when ``--insecure``."""
    if insecure:
        if keys is not None:
            raise click.UsageError("give --keys or --insecure, not both")
        click.echo(INSECURE_WARNING.format(what="the coordinator or a worker"), err=True)
        return None
    folder = keys or _default_keys()
    if not (folder / "cluster.key").exists():
        raise EdgertError(f"no cluster keystore in {folder}: run 'edgert keys init' and enrol the workers "
                          f"('edgert keys enroll NAME'), or pass --insecure for plaintext CoAP")
    return folder


def default_listen(secure: bool, port: int) -> str:
    """Where a server listens when --listen is not given."""
    return f"{'coaps+tcp' if secure else 'coap+tcp'}://0.0.0.0:{port}"


def check_listen(listen: str | None, secure: bool, udp: bool = False) -> None:
    """With credentials a server listens on coaps+tcp:// (or, for a worker, coap:// protected with OSCORE)."""
    if listen is None:
        return
    scheme = listen.partition("://")[0]
    if secure and scheme != "coaps+tcp" and not (udp and scheme == "coap"):
        raise click.UsageError(f"--listen {listen}: with credentials, listen on coaps+tcp://"
                               f"{' or coap:// (OSCORE)' if udp else ''} (plaintext needs --insecure)")
    if not secure and scheme == "coaps+tcp":
        raise click.UsageError(f"--listen {listen}: coaps+tcp needs credentials (--credential / --keys)")
