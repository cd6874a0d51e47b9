"""``edgert bench ...``: benchmarks, one subcommand per subsystem (``transport``, ``recovery``).

Add a benchmark with ``@bench.command("name")`` in this module; keep the command a
thin wrapper over a library function that returns ``{"rows": [...], "ratios": {...}}``.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgert.cli import main


@main.group()
def bench() -> None:
    """Measure edgert's subsystems (loopback, this machine)."""


@bench.command("transport")
@click.option("--json", "as_json", is_flag=True, help='Print one JSON object {"rows": [...], "ratios": {...}}.')
@click.option("--sizes", default="4KiB,64KiB,1MiB,4MiB,16MiB", show_default=True,
              help="Comma-separated tensor sizes.")
@click.option("--udp-max", default="16MiB", show_default=True, help="Largest size also sent over CoAP/UDP (slow).")
@click.option("--repeat", type=float, default=1.0, show_default=True, help="Scale the number of repetitions.")
@click.option("--strategies/--no-strategies", default=True, help="Compare large-message strategies.")
@click.option("--codecs/--no-codecs", default=True, help="Measure the compression codecs.")
def transport(as_json: bool, sizes: str, udp_max: str, repeat: float, strategies: bool, codecs: bool) -> None:
    """Raw TCP vs coap+tcp vs coap (UDP), large-message strategies and codecs."""
    from edgert.bench import transport as transport_bench

    try:
        config = transport_bench.BenchConfig(
            sizes=tuple(transport_bench.parse_size(s) for s in sizes.split(",")),
            udp_max_bytes=transport_bench.parse_size(udp_max), repeat=repeat,
            strategies=strategies, codecs=codecs)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    if repeat <= 0:
        raise click.BadParameter(f"--repeat must be > 0, got {repeat}")
    result = transport_bench.run(config)
    click.echo(json.dumps(result) if as_json else transport_bench.format_table(result))


@bench.command("recovery")
@click.option("--json", "as_json", is_flag=True, help='Print one JSON object {"rows": [...], "ratios": {...}}.')
@click.option("--model", default="cnn", show_default=True, help="Zoo model (the demo's).")
@click.option("--steps", type=int, default=100, show_default=True, help="Steps of every run.")
@click.option("--kill-at", type=int, default=50, show_default=True,
              help="Kill once this step has completed, while the victim computes.")
@click.option("--victim", type=int, default=2, show_default=True, help="Stage whose worker is killed.")
@click.option("--replicate-every", type=int, default=20, show_default=True, help="K: steps between replicas.")
@click.option("--central-every", type=int, default=100, show_default=True,
              help="Steps between copies to the coordinator.")
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--micro-batches", type=int, default=4, show_default=True)
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b", "async"]), default="1f1b", show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Learning rate of the exported plan.")
@click.option("--threads", type=int, default=1, show_default=True, help="ORT intra-op threads per worker session.")
@click.option("--repeats", type=int, default=6, show_default=True,
              help="Pairs of throughput runs (with / without replication, alternating).")
@click.option("--warmup", type=int, default=10, show_default=True, help="Steps left out of each throughput figure.")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the plan, runs and logs here (default: a temporary folder).")
def recovery(as_json: bool, **options) -> None:
    """A SIGKILL mid-step on 4 local workers: recovery vs restart, replication's cost, accuracy."""
    from edgert.cli.host import require_host_extra

    require_host_extra("bench recovery")
    from edgert.bench import recovery as recovery_bench

    result = recovery_bench.run(recovery_bench.config_from(options))
    click.echo(json.dumps(result) if as_json else recovery_bench.format_table(result))
