"""``edgert profile``: measure every device on every unit of a model, and every link.

The model is cut at every legal cut (each stage of that plan is a *unit*, the planner's
atom); each worker receives every unit in turn, then the whole model as one stage, and
times their forward and backward through its own runtime (``POST /profile``), then times
its link to every other worker (``POST /probe``); with ``split_backward``, each unit's backward as
two halves, the weight half also timed on its own (``weight_ms``). The whole-model time tells how much of a
unit's time is the fixed cost of being a stage (session calls, boundary tensors). On a device
with more than one core the whole model is timed again at a few thread counts (2, 4, 8 ... and
every core): how each direction scales with threads, by which the planner splits the cores of a
stage that runs side by side. Workers are measured one after another, so they do not compete
for a shared host's cores.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgert.coordinator.failures import health_of
from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile, ThreadScaling
from edgert.exporter.errors import ExportError
from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
from edgert.exporter.source import load_source_model
from edgert.manifest import Manifest, StageEntry, TrainingConfig
from edgert.protocol import ASSIGNMENT_PIECES, PROBE, PROFILE, Peers, ProfileOptions, StageAssignment
from edgert.run_settings import RunSettings
from edgert.security.admission import StageSigning
from edgert.security.keystore import HostSecurity
from edgert.transport import ClientConfig, Envelope, TensorClient, TransportError
from edgert.typed_data import to_data

ProgressSink = Callable[[str], None]  # told each line of progress (not progress.Progress, the training display)
PROFILE_RUN = "profile"


def unit_names(manifest: Manifest) -> list[str]:
    """A unit is named by its block, or its blocks joined with '+' when a shared parameter binds them."""
    return ["+".join(stage.blocks) for stage in manifest.stages]


@dataclass(frozen=True)
class ProfilePlans:
    """What a device is measured on: the units plan and the whole model as one stage."""

    units_dir: Path
    units: Manifest
    whole_dir: Path
    whole: Manifest


def export_profile_plans(model_path: str | Path, out_dir: Path,
                         training: TrainingConfig = TrainingConfig()) -> ProfilePlans:
    """The model cut at every legal cut (one stage per unit), and uncut."""
    source = load_source_model(model_path)
    analysis = prepare_analysis(source, ExportOptions())
    cuts = [c.index for c in analysis.cuts if c.legal]
    units = write_plan(source, analysis, cuts, out_dir / "units", training)
    whole = write_plan(source, analysis, [], out_dir / "whole", training)
    return ProfilePlans(out_dir / "units", units, out_dir / "whole", whole)


def profile_devices(model_path: str | Path, workers: list[str], micro_batch: int = ProfileOptions.micro_batch,
                    repeats: int = ProfileOptions.repeats,
                    progress: ProgressSink = lambda _: None, memory_mode: str = RunSettings.memory_mode,
                    security: HostSecurity | None = None, split_backward: bool = False) -> DevicesFile:
    """Measure ``workers`` on ``model_path``'s units and links, in ``memory_mode`` (``split_backward``: the units'
    backwards split, as edgert train --split-backward runs them); blocking.

    With ``security`` (the cluster keystore) it talks coaps+tcp and signs what it sends; without, plaintext.
    """
    if micro_batch < 1 or repeats < 1:
        raise ExportError(f"--micro-batch and --repeats must be at least 1 (got {micro_batch}, {repeats})")
    with tempfile.TemporaryDirectory(prefix="edgert-profile-") as scratch:
        plans = export_profile_plans(model_path, Path(scratch))
        progress(f"{len(plans.units.stages)} units to measure on {len(workers)} device(s)")
        return asyncio.run(_profile(plans, workers, micro_batch, repeats, progress, memory_mode, security,
                                    split_backward))


async def _profile(plans: ProfilePlans, workers: list[str], micro_batch: int, repeats: int,
                   progress: ProgressSink, memory_mode: str, security: HostSecurity | None,
                   split_backward: bool) -> DevicesFile:
    client = TensorClient(ClientConfig(timeout=600.0, retries=1, connect_timeout=5.0),
                          tls=None if security is None else security.tls)
    signing = None if security is None else security.signing
    try:
        names = [await _name(client, url) for url in workers]
        devices = []
        for url, name in zip(workers, names):
            devices.append(await profile_device(client, plans, url, name, micro_batch, repeats, progress,
                                                memory_mode, signing, split_backward=split_backward))
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
        return DevicesFile(model_sha256=plans.units.source_sha256, blocks=tuple(unit_names(plans.units)),
                           micro_batch=micro_batch, devices=tuple(devices), links=tuple(links),
                           memory_mode=memory_mode, notes={"repeats": repeats})
    finally:
        await client.close()


async def _name(client: TensorClient, url: str) -> str:
    try:
        return (await health_of(client, url, timeout=5.0)).name
    except (TransportError, OSError) as error:
        raise ExportError(f"worker {url} is not reachable: {error}") from None


async def profile_device(client: TensorClient, plans: ProfilePlans, url: str, name: str, micro_batch: int,
                         repeats: int, progress: ProgressSink = lambda _: None,
                         memory_mode: str = RunSettings.memory_mode,
                         signing: StageSigning | None = None, scaling: bool = True,
                         split_backward: bool = False) -> DeviceProfile:
    """Measure one worker on every unit (``split_backward``: their backwards split), then on the whole model as one
    stage (signed with ``signing``), and with ``scaling`` the whole model again at more threads."""
    timings = []
    for entry, unit in zip(plans.units.stages, unit_names(plans.units)):
        meta = await _post_profile(client, url, plans.units_dir, plans.units, entry, micro_batch, repeats,
                                   memory_mode, signing, split_backward=split_backward)
        timings.append(BlockTiming(**{**meta["timing"], "block": unit}))
    meta = await _post_profile(client, url, plans.whole_dir, plans.whole, plans.whole.stages[0], micro_batch,
                               repeats, memory_mode, signing)
    whole = BlockTiming(**{**meta["timing"], "block": "+".join(unit_names(plans.units))})
    timed_at = []
    for threads in thread_counts(int(meta["cores"])) if scaling else []:
        timed = (await _post_profile(client, url, plans.whole_dir, plans.whole, plans.whole.stages[0], micro_batch,
                                     repeats, memory_mode, signing, threads))["timing"]
        timed_at.append(ThreadScaling(threads, float(timed["forward_ms"]), float(timed["backward_ms"])))
    progress(f"{name}: {len(timings)} units, {whole.forward_ms + whole.backward_ms:.1f} ms per micro-batch of "
             f"{micro_batch} for the whole model"
             + "".join(f", {s.forward_ms + s.backward_ms:.1f} ms at {s.threads} threads" for s in timed_at))
    return DeviceProfile(name=name, url=url, memory_bytes=int(meta["memory_bytes"]), cores=int(meta["cores"]),
                         slowdown=str(meta.get("slowdown", "0:1")), blocks=tuple(timings), whole=whole,
                         scaling=tuple(timed_at))


def thread_counts(cores: int) -> list[int]:
    """The thread counts the whole model is timed at besides 1: the powers of two below ``cores``, and ``cores``."""
    counts = [2 ** k for k in range(1, cores.bit_length()) if 2 ** k < cores]
    return counts + [cores] if cores > 1 else []


async def _post_profile(client: TensorClient, url: str, plan: Path, manifest: Manifest, entry: StageEntry,
                        micro_batch: int, repeats: int, memory_mode: str, signing: StageSigning | None,
                        threads: int = 1, split_backward: bool = False) -> dict:
    """``POST /profile`` one stage of ``manifest`` to the worker at ``url``, its sessions with ``threads`` ORT
    threads each (``split_backward``: its backward split where the plan has the halves); its reply's meta."""
    # a stage sent to be timed trains no run: it copies nothing (the copy intervals' defaults are a run's)
    settings = RunSettings(training=manifest.training, memory_mode=memory_mode, replicate_every=0, central_every=0,
                           forward_threads=threads, backward_threads=threads, split_backward=split_backward)
    assignment = StageAssignment(run_id=PROFILE_RUN, entry=entry, stages=len(manifest.stages),
                                 peers=Peers(None, None, ""), settings=settings)
    envelope = assignment.to_envelope(assignment.read_files(plan))
    envelope = Envelope(kind=envelope.kind, run_id=envelope.run_id, stage=envelope.stage, tensors=envelope.tensors,
                        meta={**envelope.meta, **to_data(ProfileOptions(micro_batch, repeats))})
    if signing is not None:
        signing.apply(envelope)
    return (await client.post(url, PROFILE, envelope, timeout=600.0, pieces=ASSIGNMENT_PIECES)).envelope().meta
