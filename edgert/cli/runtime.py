"""``edgert worker`` and ``edgert train``: the runtime on a device and the central node."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
from pathlib import Path

import click

from edgert.cli import main
from edgert.cli.keys import INSECURE_WARNING, default_listen, host_keys, worker_credentials
from edgert.cli.params import CoapUrl, CoapUrlList, CodecSpec
from edgert.errors import EdgertError
from edgert.manifest import MEMORY_MODES
from edgert.run_settings import RunSettings
from edgert.schedule import SCHEDULES
from edgert.transport.coap_tcp import DEFAULT_PORT


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


@main.command("worker")
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
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning")
def worker_command(listen: str | None, credential: Path | None, insecure: bool, name: str, slowdown: str | None,
                   slowdown_schedule: str | None, workdir: Path | None, join: str | None, advertise: str | None,
                   providers: str, log_level: str) -> None:
    """Run the on-device runtime: serve CoAP, train whatever stage the coordinator assigns."""
    from edgert.providers import check_available, parse_providers
    from edgert.worker.slowdown import SlowdownSchedule
    from edgert.worker.worker import Worker, WorkerConfig

    _logging(log_level)
    if slowdown and slowdown_schedule:
        raise click.UsageError("give --slowdown or --slowdown-schedule, not both")
    tls = worker_credentials(credential, insecure)
    name = _worker_name(name, tls)
    _check_listen(listen, tls is not None, udp=True)
    schedule = SlowdownSchedule.parse(slowdown_schedule or slowdown or "1")
    config = WorkerConfig(listen=listen or default_listen(tls is not None, DEFAULT_PORT), name=name, slowdown=schedule,
                          workdir=workdir, join=join, advertise=advertise, tls=tls,
                          providers=check_available(parse_providers(providers)))
    asyncio.run(_serve(Worker(config)))


def _worker_name(name: str | None, tls) -> str:
    """The credential's name (a different ``--name`` is refused); with --insecure, --name or the host name."""
    if tls is None:
        return name or socket.gethostname()
    if name is not None and name != tls.identity.name:
        raise EdgertError(f"--name {name} does not match the name in {tls.path.name} ({tls.identity.name!r}); "
                          f"leave --name out to use the credential's")
    return tls.identity.name


def _check_listen(listen: str | None, secure: bool, udp: bool = False) -> None:
    """With credentials a server listens on coaps+tcp:// (or, for a worker, coap:// protected with OSCORE)."""
    if listen is None:
        return
    scheme = listen.partition("://")[0]
    if secure and scheme != "coaps+tcp" and not (udp and scheme == "coap"):
        raise click.UsageError(f"--listen {listen}: with credentials, listen on coaps+tcp://"
                               f"{' or coap:// (OSCORE)' if udp else ''} (plaintext needs --insecure)")
    if not secure and scheme == "coaps+tcp":
        raise click.UsageError(f"--listen {listen}: coaps+tcp needs credentials (--credential / --keys)")


async def _serve(worker) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    url = await worker.start()
    click.echo(f"edgert worker {worker.config.name} listening on {url} (slowdown {worker.config.slowdown})")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await worker.shutdown()
        click.echo(f"edgert worker {worker.config.name} stopped")


@main.command("train")
@click.argument("plan", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--workers", type=CoapUrlList(), default=None, help="Worker URLs in stage order, comma-separated.")
@click.option("--data", default="digits", show_default=True, help="digits, tokens, or a .npz (x, y[, x_test, y_test]).")
@click.option("--epochs", type=int, default=5, show_default=True)
@click.option("--steps", type=int, default=None, help="Stop after this many optimizer steps.")
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--micro-batches", type=int, default=4, show_default=True)
@click.option("--schedule", type=click.Choice(SCHEDULES), default="1f1b", show_default=True)
@click.option("--lr", "learning_rate", type=float, default=None, help="Override the plan's learning rate.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--codec", type=CodecSpec(), default=RunSettings.forward_codec, show_default=True,
              help="Codec for activations: none, fp16, int8, int4 (int8:axis=1: per channel).")
@click.option("--grad-codec", type=CodecSpec(), default=RunSettings.backward_codec, show_default=True,
              help="Codec for gradients: none, fp16, int8, int4, topk:RATIO (e.g. topk:0.01) or topk:k=N.")
@click.option("--threads", type=int, default=RunSettings.forward_threads, show_default=True,
              help="ORT intra-op threads per worker session.")
@click.option("--memory-mode", type=click.Choice(MEMORY_MODES), default=RunSettings.memory_mode, show_default=True,
              help="recompute: keep each in-flight micro-batch's inputs, recompute its forward in the backward; "
                   "stash: keep the activations the backward needs, recompute nothing (faster, more memory).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run folder (metrics.jsonl, trace.json, checkpoints); default a new runs/<date>-<n>. "
                   "A folder that holds a run is refused (see --resume, --overwrite).")
@click.option("--overwrite", is_flag=True, help="Replace the run in --out (its records are deleted).")
@click.option("--listen", type=CoapUrl(), default=None,
              help="Where workers report to (default coaps+tcp://0.0.0.0:0, coap+tcp://... with --insecure).")
@click.option("--keys", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Cluster keystore (default $EDGERT_KEYS or ~/.edgert/cluster; edgert keys init).")
@click.option("--insecure", is_flag=True, help="Plaintext CoAP without authentication (prints a warning).")
@click.option("--advertise", default=None, help="Host workers reach this coordinator at (default: auto).")
@click.option("--step-timeout", type=float, default=RunSettings.wait_timeout, show_default=True)
@click.option("--replan", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="Move the cuts while training when measured stage times drift.")
@click.option("--replan-every", type=int, default=10, show_default=True, help="Steps between re-planning checks.")
@click.option("--replan-threshold", type=float, default=0.1, show_default=True,
              help="Re-plan only for a predicted speed-up above this fraction.")
@click.option("--replan-at", multiple=True, help='Force a re-plan before a step: "STEP" or "STEP:CUT,CUT" (block '
              "indices). Repeatable.")
@click.option("--devices", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="devices.json from `edgert profile`, for re-planning.")
@click.option("--replicate-every", type=int, default=RunSettings.replicate_every, show_default=True,
              help="Steps between each stage's copies to the next workers (0: off).")
@click.option("--central-every", type=int, default=RunSettings.central_every, show_default=True,
              help="Steps between copies to this coordinator, kept on disk (0: off).")
@click.option("--replicas", type=int, default=1, show_default=True, help="Neighbours each stage's copy goes to.")
@click.option("--resume", "resume_run", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue the run in this folder, and record there, from its newest snapshot "
                   "(PLAN and options come from it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary object on stdout.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning")
def train_command(plan: Path, workers: tuple[str, ...] | None, data: str, epochs: int, steps: int | None,
                  batch_size: int, micro_batches: int, schedule: str, learning_rate: float | None, seed: int,
                  codec: str, grad_codec: str, threads: int, memory_mode: str, out_dir: Path | None, overwrite: bool,
                  listen: str | None, keys: Path | None,
                  insecure: bool, advertise: str | None,
                  step_timeout: float, replan: str, replan_every: int, replan_threshold: float,
                  replan_at: tuple[str, ...], devices: Path | None, replicate_every: int, central_every: int,
                  replicas: int, resume_run: Path | None, as_json: bool, log_level: str) -> None:
    """Train PLAN across WORKERS (one per stage) and record the run."""
    from edgert.coordinator.coordinator import TrainConfig, resumed_config, train
    from edgert.coordinator.runlog import new_run_folder

    _logging(log_level)
    if resume_run is not None and (out_dir is not None or overwrite):
        raise click.UsageError("--resume records in the run folder it continues: give no --out or --overwrite")
    if resume_run is not None:
        config = resumed_config(resume_run, list(workers) if workers else None)
        click.echo(f"run folder: {resume_run} (resumed)", err=True)
        if config.keys is None:
            click.echo(INSECURE_WARNING.format(what="the coordinator or a worker"), err=True)
        print_summary(train(config), as_json)
        return
    if plan is None or not workers:
        raise click.UsageError("give PLAN and --workers (or --resume RUN_DIR)")
    keys = host_keys(keys, insecure)
    _check_listen(listen, keys is not None)
    forced = tuple(_forced_replan(text) for text in replan_at)  # a bad one is refused before a folder is made
    chosen = out_dir is None
    if chosen:
        out_dir = new_run_folder()
        click.echo(f"run folder: {out_dir}", err=True)
    config = TrainConfig(
        plan_dir=plan, workers=workers, out_dir=out_dir,
        data=data, epochs=epochs, steps=steps, batch_size=batch_size, micro_batches=micro_batches,
        schedule=schedule, learning_rate=learning_rate, seed=seed, forward_codec=codec, backward_codec=grad_codec,
        forward_threads=threads, backward_threads=threads, listen=listen or default_listen(keys is not None, 0),
        keys=keys, advertise=advertise,
        step_timeout=step_timeout, replan=replan, replan_every=replan_every, replan_threshold=replan_threshold,
        replan_at=forced, devices=devices, memory_mode=memory_mode,
        replicate_every=replicate_every, central_every=central_every, replicas=replicas, overwrite=overwrite)
    try:
        summary = train(config)
    except BaseException:
        if chosen and not any(out_dir.iterdir()):
            out_dir.rmdir()  # the run failed before recording anything: leave no empty runs/<date>-<n>
        raise
    print_summary(summary, as_json)


def _forced_replan(text: str) -> tuple[int, tuple[int, ...] | None]:
    step, _, cuts = text.partition(":")
    try:
        return int(step), tuple(int(c) for c in cuts.split(",")) if cuts else None
    except ValueError:
        raise click.BadParameter(f"--replan-at {text!r}: expected STEP or STEP:CUT,CUT") from None


def print_summary(summary, as_json: bool) -> None:
    """The end-of-run summary: a JSON object, or a few lines for people."""
    from dataclasses import asdict

    if as_json:
        click.echo(json.dumps(asdict(summary)))
        return

    def shown(figure: float | None) -> str:  # no evaluation yet: no test figures
        return "n/a" if figure is None else f"{figure:.4f}"

    click.echo(f"run {summary.run_dir}: {summary.steps} steps ({summary.schedule}), {summary.samples_per_s:.1f} "
               f"samples/s, test accuracy {shown(summary.test_accuracy)}, test loss {shown(summary.test_loss)}")
    for k, (name, share) in enumerate(zip(summary.workers, summary.stage_utilisation)):
        click.echo(f"  stage {k} on {name}: {share * 100:.1f}% busy")


@main.command("profile")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--workers", type=CoapUrlList(), required=True, help="Worker URLs, comma-separated.")
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--micro-batch", type=int, default=16, show_default=True, help="Samples per measured micro-batch.")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--memory-mode", type=click.Choice(MEMORY_MODES), default=RunSettings.memory_mode, show_default=True,
              help="Measure the backward as training will run it (edgert train --memory-mode).")
@click.option("--keys", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Cluster keystore (default $EDGERT_KEYS or ~/.edgert/cluster).")
@click.option("--insecure", is_flag=True, help="Plaintext CoAP without authentication (prints a warning).")
def profile_command(model: Path, workers: tuple[str, ...], out_path: Path, micro_batch: int, repeats: int,
                    memory_mode: str, keys: Path | None, insecure: bool) -> None:
    """Measure each worker on MODEL's units (forward, backward, memory) and every link between workers."""
    from edgert.cli.host import require_host_extra

    require_host_extra("profile")
    from edgert.coordinator.profiling import profile_devices
    from edgert.devices import save_devices
    from edgert.security.keystore import HostSecurity

    folder = host_keys(keys, insecure)
    devices = profile_devices(model, list(workers), micro_batch, repeats, progress=lambda m: click.echo(m, err=True),
                              memory_mode=memory_mode, security=None if folder is None else HostSecurity.open(folder))
    save_devices(devices, out_path)
    for device in devices.devices:
        whole = device.whole
        total = whole.forward_ms + whole.backward_ms if whole else sum(t.forward_ms + t.backward_ms
                                                                         for t in device.blocks)
        click.echo(f"{device.name}: {total:.2f} ms per micro-batch (forward + backward, whole model), "
                   f"{device.cores} cores, {device.memory_bytes / 2**20:.0f} MiB available")
    for link in devices.links:
        megabytes = link.bandwidth_bytes_per_s / 1e6
        click.echo(f"{link.source} -> {link.target}: {megabytes:.1f} MB/s, rtt {link.rtt_ms:.2f} ms")
    click.echo(f"wrote {out_path}")
