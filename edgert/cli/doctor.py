"""``edgert doctor``: is this board ready to be a worker (edgert.worker.readiness)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from edgert.cli.table import format_table
from edgert.transport.coap_tcp import DEFAULT_PORT


@click.command("doctor")
@click.option("--providers", default="cpu", show_default=True, envvar="EDGERT_PROVIDERS",
              help="The execution providers the worker will be started with.")
@click.option("--credential", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar="EDGERT_CREDENTIAL", help="The credential file the worker will use.")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="The port the worker will listen on.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The worker's --workdir (default: the temporary folder).")
@click.option("--plan", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A plan folder exported on the host: load and train one micro-batch of every stage here.")
def doctor_command(providers: str, credential: Path | None, port: int, workdir: Path | None,
                   plan: Path | None) -> None:
    from edgert.worker.readiness import FAIL, ReadinessOptions, check_board

    options = ReadinessOptions(providers=providers, credential=credential, listen_port=port, workdir=workdir,
                               plan=plan)
    rows = []
    for finding in check_board(options):
        rows.append((finding.what, finding.status, finding.detail))
    click.echo(format_table(["check", "", "detail"], rows))
    failed = [row for row in rows if row[1] == FAIL]
    click.echo(f"{'NOT READY' if failed else 'READY'}: {len(rows) - len(failed)} of {len(rows)} checks passed")
    sys.exit(1 if failed else 0)
