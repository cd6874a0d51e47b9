"""``edgert bench ...``: benchmarks, one subcommand per subsystem (``transport`` here; more join the group).

Add a benchmark with ``@bench.command("name")`` in this module; keep the command a
thin wrapper over a library function that returns ``{"rows": [...], "ratios": {...}}``.
"""

from __future__ import annotations

import json

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
    from edgert.transport import bench as transport_bench

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
