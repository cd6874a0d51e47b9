"""``edgert profile``: measure every device on every unit of a model, and every link.

The model is cut at every legal cut (each stage of that plan is a *unit*, the planner's
atom); each worker receives every unit in turn and times its forward and backward through
its own runtime (``POST /profile``), then times its link to every other worker
(``POST /probe``). Workers are measured one after another, so they do not compete for a
shared host's cores.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path

from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile
from edgert.exporter.errors import ExportError
from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
from edgert.exporter.source import load_source_model
from edgert.manifest import RUNTIME_ROLES, Manifest, TrainingConfig
from edgert.protocol import HEALTH, PROBE, PROFILE, Health, Peers, StageAssignment
from edgert.transport import ClientConfig, Envelope, TensorClient, TransportError

Progress = Callable[[str], None]
PROFILE_RUN = "profile"


def unit_names(manifest: Manifest) -> list[str]:
    """A unit is named by its block, or its blocks joined with '+' when a shared parameter binds them."""
    return ["+".join(stage.blocks) for stage in manifest.stages]


def export_units(model_path: str | Path, out_dir: Path, training: TrainingConfig = TrainingConfig()) -> Manifest:
    """The model cut at every legal cut: one stage per unit."""
    source = load_source_model(model_path)
    analysis = prepare_analysis(source, ExportOptions())
    cuts = [c.index for c in analysis.cuts if c.legal]
    return write_plan(source, analysis, cuts, out_dir, training)


def profile_devices(model_path: str | Path, workers: list[str], micro_batch: int = 16, repeats: int = 5,
                    progress: Progress = lambda _: None) -> DevicesFile:
    """Measure ``workers`` on ``model_path``'s units and links; blocking."""
    if micro_batch < 1 or repeats < 1:
        raise ExportError(f"--micro-batch and --repeats must be at least 1 (got {micro_batch}, {repeats})")
    with tempfile.TemporaryDirectory(prefix="edgert-profile-") as scratch:
        manifest = export_units(model_path, Path(scratch) / "units")
        progress(f"{len(manifest.stages)} units to measure on {len(workers)} device(s)")
        return asyncio.run(_profile(Path(scratch) / "units", manifest, workers, micro_batch, repeats, progress))


async def _profile(plan: Path, manifest: Manifest, workers: list[str], micro_batch: int, repeats: int,
                   progress: Progress) -> DevicesFile:
    client = TensorClient(ClientConfig(timeout=600.0, retries=1, connect_timeout=5.0))
    try:
        names = [await _name(client, url) for url in workers]
        devices = []
        for url, name in zip(workers, names):
            devices.append(await profile_device(client, plan, manifest, url, name, micro_batch, repeats, progress))
        links = []
        for i, source in enumerate(workers):
            for j, target in enumerate(workers):
                if i != j:
                    result = (await client.post(source, PROBE, Envelope(kind="control", meta={"target": target}),
                                                timeout=120.0)).envelope().meta
                    links.append(LinkProfile(names[i], names[j], float(result["bandwidth_bytes_per_s"]),
                                             float(result["rtt_ms"])))
        if links:
            progress(f"measured {len(links)} link(s)")
        return DevicesFile(model_sha256=manifest.source_sha256, blocks=tuple(unit_names(manifest)),
                           micro_batch=micro_batch, devices=tuple(devices), links=tuple(links),
                           notes={"repeats": repeats})
    finally:
        await client.close()


async def _name(client: TensorClient, url: str) -> str:
    try:
        return Health.from_envelope((await client.get(url, HEALTH, timeout=5.0)).envelope()).name
    except (TransportError, OSError) as error:
        raise ExportError(f"worker {url} is not reachable: {error}") from None


async def profile_device(client: TensorClient, plan: Path, manifest: Manifest, url: str, name: str,
                         micro_batch: int, repeats: int, progress: Progress = lambda _: None) -> DeviceProfile:
    """Measure one worker on every unit of the units plan in ``plan``."""
    timings, cores, memory, slowdown = [], 1, 0, "0:1"
    for entry, unit in zip(manifest.stages, unit_names(manifest)):
        assignment = StageAssignment(run_id=PROFILE_RUN, entry=entry, training=manifest.training,
                                     stages=len(manifest.stages), peers=Peers(None, None, ""))
        files = {a.role: (plan / a.path).read_bytes() for a in entry.artifacts if a.role in RUNTIME_ROLES}
        envelope = assignment.to_envelope(files)
        envelope = Envelope(kind=envelope.kind, run_id=envelope.run_id, stage=envelope.stage,
                            tensors=envelope.tensors,
                            meta={**envelope.meta, "micro_batch": micro_batch, "repeats": repeats})
        meta = (await client.post(url, PROFILE, envelope, timeout=600.0)).envelope().meta
        timings.append(BlockTiming(**{**meta["timing"], "block": unit}))
        cores, memory, slowdown = int(meta["cores"]), int(meta["memory_bytes"]), str(meta.get("slowdown", "0:1"))
    total = sum(t.forward_ms + t.backward_ms for t in timings)
    progress(f"{name}: {len(timings)} units, {total:.1f} ms per micro-batch of {micro_batch} for the whole model")
    return DeviceProfile(name=name, url=url, memory_bytes=memory, cores=cores, slowdown=slowdown,
                         blocks=tuple(timings))
