"""``edgert worker``: the on-device runtime (board-side code only: no host extra, no coordinator)."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import click

from edgert.cli.keys import check_listen, default_listen, worker_credentials
from edgert.cli.params import CoapUrl, log_level_option, start_logging
from edgert.errors import EdgertError
from edgert.transport.coap_tcp import DEFAULT_PORT


@click.command("worker")
@click.option("--listen", type=CoapUrl(), default=None,
              help=f"URL to serve on (default coaps+tcp://0.0.0.0:{DEFAULT_PORT}, or coap+tcp://... with --insecure; "
                   "port 0 picks a free port). coap://... with a credential takes OSCORE requests from the "
                   "coordinator only.")
@click.option("--credential", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar="EDGERT_CREDENTIAL", help="This device's credential file (edgert keys enroll NAME).")
@click.option("--insecure", is_flag=True, help="Plaintext CoAP without authentication (prints a warning).")
@click.option("--name", default=None, help="Name shown in metrics and traces (default: the name in the credential; "
                                         "with --insecure, the host name). Must match the credential's.")
@click.option("--slowdown", default=None, help="Emulate a device F times slower (sleeps (F-1)x each compute).")
@click.option("--slowdown-schedule", default=None, help='Slowdown by step, e.g. "0:1,30:8".')
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where received stage files go (default: a temporary folder).")
@click.option("--join", type=CoapUrl(), default=None,
              help="URL of a running coordinator to join (its --listen address).")
@click.option("--advertise", default=None, help="Host the coordinator and peers reach this worker at.")
@click.option("--providers", default="cpu", show_default=True, envvar="EDGERT_PROVIDERS",
              help="onnxruntime execution providers, best first, e.g. cuda,cpu on a Jetson with onnxruntime-gpu "
                   "(the CPU always comes last).")
@log_level_option
def worker_command(listen: str | None, credential: Path | None, insecure: bool, name: str, slowdown: str | None,
                   slowdown_schedule: str | None, workdir: Path | None, join: str | None, advertise: str | None,
                   providers: str, log_level: str) -> None:
    from edgert.providers import check_available, parse_providers
    from edgert.worker.slowdown import SlowdownSchedule
    from edgert.worker.worker import Worker, WorkerConfig

    start_logging(log_level)
    if slowdown and slowdown_schedule:
        raise click.UsageError("give --slowdown or --slowdown-schedule, not both")
    tls = worker_credentials(credential, insecure)
    name = _worker_name(name, tls)
    check_listen(listen, tls is not None, udp=True)
    schedule = SlowdownSchedule.parse(slowdown_schedule or slowdown or "1")
    config = WorkerConfig(listen=listen or default_listen(tls is not None, DEFAULT_PORT), name=name, slowdown=schedule,
                          workdir=workdir, join=join, advertise=advertise, tls=tls,
                          providers=check_available(parse_providers(providers)))
    asyncio.run(_serve(Worker(config, say=lambda line: click.echo(f"edgert worker {name}: {line}"))))


def _worker_name(name: str | None, tls) -> str:
    """The credential's name (a different ``--name`` is refused); with --insecure, --name or the host name."""
    if tls is None:
        return name or socket.gethostname()
    if name is not None and name != tls.identity.name:
        raise EdgertError(f"--name {name} does not match the name in {tls.path.name} ({tls.identity.name!r}); "
                          f"leave --name out to use the credential's")
    return tls.identity.name


async def _serve(worker) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    url = await worker.start()
    click.echo(f"edgert worker {worker.config.name} listening on {url} (slowdown {worker.config.slowdown})")
    sys.stdout.flush()
    waiting = [loop.create_task(stop.wait())]
    if worker.joining is not None:  # a coordinator that refuses the worker leaves it nothing to do
        waiting.append(loop.create_task(worker.joining.refused.wait()))
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if worker.joining is not None and worker.joining.refusal:
            raise EdgertError(worker.joining.refusal)
    finally:
        for task in waiting:
            task.cancel()
        await worker.shutdown()
        click.echo(f"edgert worker {worker.config.name} stopped")
