"""``edgert profile``: measure the workers and the links between them for the planner (host).

Its defaults are those of :class:`edgert.protocol.ProfileOptions` (what ``POST /profile`` asks a
worker) and :class:`edgert.run_settings.RunSettings` (the memory mode training will use).
"""

from __future__ import annotations

from pathlib import Path

import click

from edgert.cli.keys import host_keys
from edgert.cli.params import CoapUrlList
from edgert.manifest import MEMORY_MODES
from edgert.protocol import ProfileOptions
from edgert.run_settings import RunSettings


@click.command("profile")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--workers", type=CoapUrlList(), required=True, help="Worker URLs, comma-separated.")
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--micro-batch", type=int, default=ProfileOptions.micro_batch, show_default=True,
              help="Samples per measured micro-batch.")
@click.option("--repeats", type=int, default=ProfileOptions.repeats, show_default=True)
@click.option("--memory-mode", type=click.Choice(MEMORY_MODES), default=RunSettings.memory_mode, show_default=True,
              help="Measure the backward as training will run it (edgert train --memory-mode).")
@click.option("--split-backward", is_flag=True,
              help="Time each unit's backward split in two, as edgert train --split-backward runs it: the weight "
                   "gradients' share (weight_ms) lets edgert plan --split-backward cost the split.")
@click.option("--keys", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Cluster keystore (default $EDGERT_KEYS or ~/.edgert/cluster).")
@click.option("--insecure", is_flag=True, help="Plaintext CoAP without authentication (prints a warning).")
def profile_command(model: Path, workers: tuple[str, ...], out_path: Path, micro_batch: int, repeats: int,
                    memory_mode: str, split_backward: bool, keys: Path | None, insecure: bool) -> None:
    from edgert.cli.host import require_host_extra

    require_host_extra("profile")
    from edgert.coordinator.profiling import profile_devices
    from edgert.devices import save_devices
    from edgert.security.keystore import HostSecurity

    folder = host_keys(keys, insecure)
    devices = profile_devices(model, list(workers), micro_batch, repeats, progress=lambda m: click.echo(m, err=True),
                              memory_mode=memory_mode, security=None if folder is None else HostSecurity.open(folder),
                              split_backward=split_backward)
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
