"""``edgert export``, ``edgert inspect`` and ``edgert check``: cutting a model into a plan."""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgert.cli.host import require_host_extra
from edgert.cli.table import format_table, human_bytes, human_count
from edgert.coordinator.coordinator import TrainConfig
from edgert.manifest import MEMORY_MODES, OPTIMIZERS, TrainingConfig
from edgert.run_settings import RunSettings
from edgert.schedule import SCHEDULES


def _progress(message: str) -> None:
    click.echo(message, err=True)


def _split(values: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in values.split(",") if v.strip()) if values else ()


@click.command("export")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Plan folder to write.")
@click.option("--stages", type=int, default=None, help="Number of stages; cuts balanced by FLOPs.")
@click.option("--cuts", default=None, help="Explicit cuts: block indices, block names or node names, comma-separated.")
@click.option("--loss", type=click.Choice(["cross-entropy", "mse"]), default=None,
              help="Loss on the last stage (default: the model's edgert.loss metadata, else cross-entropy).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=TrainingConfig.optimizer, show_default=True)
@click.option("--lr", "learning_rate", type=float, default=TrainingConfig.learning_rate, show_default=True)
@click.option("--weight-decay", type=float, default=TrainingConfig.weight_decay, show_default=True)
@click.option("--momentum", type=float, default=TrainingConfig.momentum, show_default=True, help="SGD momentum.")
@click.option("--output", default=None, help="Graph output that is the prediction (default: the first).")
@click.option("--block-depth", type=int, default=None, help="Name-scope depth that defines blocks (default: auto).")
@click.option("--frozen", default=None, help="Initializers not to train, comma-separated.")
@click.option("--split-backward", is_flag=True,
              help="Balance --stages for edgert train --split-backward: the stages after the first compute their "
                   "weight gradients once a step, off the pipeline's path, so they take more blocks.")
def export_command(model: Path, out_dir: Path, stages: int | None, cuts: str | None, loss: str | None,
                   optimizer: str, learning_rate: float, weight_decay: float, momentum: float,
                   output: str | None, block_depth: int | None, frozen: str | None, split_backward: bool) -> None:
    require_host_extra("export")
    from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
    from edgert.exporter.source import load_source_model

    source = load_source_model(model)
    metadata = {p.key: p.value for p in source.model.metadata_props}
    loss_name = (loss or metadata.get("edgert.loss", "cross_entropy")).replace("-", "_")
    training = TrainingConfig(loss=loss_name, optimizer=optimizer, learning_rate=learning_rate,
                              weight_decay=weight_decay, momentum=momentum)
    options = ExportOptions(stages=stages, cuts=_split(cuts), output=output, block_depth=block_depth,
                            frozen=_split(frozen), training=training, split_backward=split_backward)
    analysis = prepare_analysis(source, options)
    for note in analysis.trainable.notes:
        _progress(note)
    _progress(f"{model.name}: {len(analysis.blocks)} blocks, {human_count(analysis.param_count)} parameters, "
              f"{human_count(analysis.total_flops)} FLOPs/sample")
    chosen = choose_cuts(analysis, options)
    manifest = write_plan(source, analysis, chosen, out_dir, training, _progress)
    click.echo(_stage_table(manifest, out_dir))


@click.command("inspect")
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--block-depth", type=int, default=None, help="For an .onnx file: name-scope depth of blocks.")
def inspect_command(target: Path, as_json: bool, block_depth: int | None) -> None:
    if target.is_dir():
        from edgert.manifest import load_manifest

        manifest = load_manifest(target, verify=False)
        click.echo(json.dumps(manifest.to_json(), indent=2) if as_json else _stage_table(manifest, target))
        return
    require_host_extra("inspect")
    from edgert.exporter.export import ExportOptions, prepare_analysis
    from edgert.exporter.source import load_source_model

    analysis = prepare_analysis(load_source_model(target), ExportOptions(block_depth=block_depth))
    if as_json:
        click.echo(json.dumps(_analysis_json(analysis), indent=2))
    else:
        click.echo(_block_table(analysis))


@click.command("check")
@click.argument("plan", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--model", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The source model (default: the copy in the plan folder).")
@click.option("--steps", type=int, default=3, show_default=True, help="Optimizer steps to compare.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tolerance", type=float, default=1e-5, show_default=True,
              help="The least relative difference allowed, however small float32's own error (docs/EXPORTER.md).")
@click.option("--reference", type=click.Choice(["float64", "training-build"]), default="float64", show_default=True,
              help="training-build: also compare every stage with the ONNX Runtime training build's gradients "
                   "(needs the training build: the reference extra).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def check_command(plan: Path, model: Path | None, steps: int, batch_size: int, seed: int, tolerance: float,
                  reference: str, as_json: bool) -> None:
    require_host_extra("check")
    from edgert.exporter.check import FLOOR_FACTOR, check_plan

    report = check_plan(plan, model, steps=steps, batch_size=batch_size, seed=seed, tolerance=tolerance,
                        reference=reference, progress=(lambda _: None) if as_json else _progress)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        rows = [(d.stage, f"{d.max_grad_rel_diff:.2e}", f"{d.grad_floor:.2e}", f"{d.max_param_rel_diff:.2e}",
                 f"{d.param_floor:.2e}", "ok" if d.ok else "FAIL") for d in report.stages]
        click.echo(format_table(["stage", "gradient vs float64", "float32 floor", f"parameters ({steps} steps)",
                                 "float32 floor", ""], rows))
        click.echo(f"loss {report.loss:.6f} vs float64 {report.reference_loss:.6f} (difference {report.loss_diff:.2e}, "
                   f"allowed {report.loss_allowed:.2e})")
        click.echo(f"gradient formulas: float64 gradients vs central differences {report.formula_error:.2e} "
                   f"(allowed {report.formula_tolerance:.0e})")
        for comparison in report.training_build:
            click.echo(f"stage {comparison.stage} {comparison.memory_mode}: vs the training build "
                       f"{comparison.largest:.2e}{'' if comparison.ok else '  FAIL'}")
        for note in report.notes:
            click.echo(f"note: {note}")
        verdict = "PASS" if report.ok else "FAIL"
        click.echo(f"{verdict}: every difference within {FLOOR_FACTOR:g}x float32's own error against float64 "
                   f"(at least {tolerance:.0e})" if report.ok else f"{verdict}: see the rows marked FAIL above")
    if not report.ok:
        raise SystemExit(1)


def _progress(message: str) -> None:
    click.echo(message, err=True)


@click.command("merge")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--training-form", is_flag=True,
              help="Keep the source model's training-mode operators (Dropout, BatchNormalization's training_mode) "
                   "as exported, for fine-tuning elsewhere. Default: the inference form, ready to serve (no "
                   "Dropout, BatchNorm on the run's running statistics: the same input, the same output).")
def merge_command(run: Path, out_path: Path, training_form: bool) -> None:
    require_host_extra("merge")
    from edgert.exporter.merge import merge_run

    result = merge_run(run, out_path, training_form=training_form)
    if result.inference is None:
        form = "training form kept"
    else:
        form = (f"inference form: {result.inference.dropouts} Dropout removed, {result.inference.batchnorms} "
                "BatchNormalization on running statistics")
    click.echo(f"wrote {out_path}: {result.replaced} trained tensors from step {result.step + 1} ({form})")
    click.echo(f"use it: edgert evaluate {out_path}   |   edgert predict {out_path} INPUT")


def _stage_table(manifest, plan_dir: Path) -> str:
    rows = []
    for stage in manifest.stages:
        blocks = stage.blocks[0] if len(stage.blocks) == 1 else f"{stage.blocks[0]} .. {stage.blocks[-1]}"
        outputs = ", ".join(f"{t.name}{list(t.shape)}" for t in stage.outputs)
        size = sum(a.bytes for a in stage.artifacts)
        params = sum(int(_numel(p.shape)) for p in stage.parameters if p.trainable)
        rows.append((stage.index, f"{blocks} ({len(stage.blocks)})", human_count(params),
                     human_count(stage.flops_per_sample), outputs, human_bytes(size)))
    table = format_table(["stage", "blocks", "params", "FLOPs/sample", "sends forward", "artifacts"], rows)
    return f"{table}\nplan: {plan_dir}  loss: {manifest.training.loss}  optimizer: {manifest.training.optimizer}"


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _block_table(analysis) -> str:
    rows = []
    for block in analysis.blocks:
        cut = analysis.cut_before(block.index) if block.index else None
        crossing = ""
        if cut is not None:
            crossing = f"{len(cut.tensors)} tensor(s), {human_bytes(cut.bytes_per_sample)}/sample"
            crossing += "" if cut.legal else f" (illegal: {cut.why_illegal})"
        rows.append((block.index, block.name, len(block.nodes), human_count(block.flops),
                     human_bytes(block.param_bytes), crossing))
    table = format_table(["block", "name", "nodes", "FLOPs/sample", "params", "cut before it carries"], rows)
    return (f"{table}\n{len(analysis.blocks)} blocks (scope depth {analysis.block_depth}); "
            f"cut with --cuts INDEX,... or --stages N")


def _analysis_json(analysis) -> dict:
    return {
        "blocks": [{"index": b.index, "name": b.name, "nodes": len(b.nodes), "flops": b.flops,
                    "param_bytes": b.param_bytes} for b in analysis.blocks],
        "cuts": [{"index": c.index, "before_block": c.before_block, "after_node": c.after_node, "legal": c.legal,
                  "bytes_per_sample": c.bytes_per_sample, "tensors": [t.to_json() for t in c.tensors]}
                 for c in analysis.cuts],
        "param_count": analysis.param_count,
        "total_flops": analysis.total_flops,
    }


@click.command("plan")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--devices", "devices_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="devices.json from `edgert profile`.")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--batch-size", type=int, default=TrainConfig.batch_size, show_default=True)
@click.option("--micro-batches", type=int, default=TrainConfig.micro_batches, show_default=True)
@click.option("--schedule", type=click.Choice(SCHEDULES), default=TrainConfig.schedule, show_default=True)
@click.option("--memory-mode", type=click.Choice(MEMORY_MODES), default=RunSettings.memory_mode, show_default=True)
@click.option("--lr", "learning_rate", type=float, default=TrainingConfig.learning_rate, show_default=True)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=TrainingConfig.optimizer, show_default=True)
@click.option("--groups/--no-groups", "allow_groups", default=True, show_default=True,
              help="Let a stage run on a group of devices that split each micro-batch, where that pays "
                   "(--no-groups: one device a stage).")
@click.option("--side-by-side/--one-after-the-other", default=False, show_default=True,
              help="Plan for stages that run their forwards beside their backwards (1f1b, devices with 2 cores or "
                   "more): each device's cores split between the two; edgert train then runs so.")
@click.option("--split-backward/--whole-backward", default=False, show_default=True,
              help="Plan for stages that compute their weight gradients once a step (1f1b, gpipe; not the first "
                   "stage), costed by the weight times of devices.json (edgert profile --split-backward); edgert "
                   "train then runs so.")
@click.option("--json", "as_json", is_flag=True, help="Print placement.json's content.")
def plan_command(model: Path, devices_path: Path, out_dir: Path, batch_size: int, micro_batches: int, schedule: str,
                 memory_mode: str, learning_rate: float, optimizer: str, allow_groups: bool, side_by_side: bool,
                 split_backward: bool, as_json: bool) -> None:
    require_host_extra("plan")
    from dataclasses import asdict

    from edgert.exporter.device_plan import plan_for_devices

    training = TrainingConfig(optimizer=optimizer, learning_rate=learning_rate)
    _, placement = plan_for_devices(model, devices_path, out_dir, training, batch_size, micro_batches, schedule,
                                    memory_mode, allow_groups, side_by_side, split_backward)
    if split_backward and not _has_weight_times(devices_path):
        click.echo(f"warning: {devices_path} has no weight-gradient times: the stages after the first are costed with "
                   f"their whole backward (measure them with edgert profile --split-backward)", err=True)
    if as_json:
        click.echo(json.dumps(asdict(placement)))
        return
    rows = [(s.index, _devices_of(s), f"{s.blocks[0]} .. {s.blocks[-1]} ({len(s.blocks)})", f"{s.compute_ms:.2f}",
             f"{s.forward_threads}/{s.backward_threads}",
             placement.link_codecs[s.index] if s.index < len(placement.link_codecs) else "")
            for s in placement.stages]
    click.echo(format_table(["stage", "device (a group: shares)", "blocks", "predicted ms/micro-batch",
                             "threads fwd/bwd", "codec to next"], rows))
    click.echo(f"bottleneck {placement.bottleneck_ms:.2f} ms per micro-batch; predicted step "
               f"{placement.predicted_step_ms:.1f} ms ({placement.schedule}, {placement.micro_batches} micro-batches)")
    if placement.unused_devices:
        click.echo(f"not used (they would slow the pipeline): {', '.join(placement.unused_devices)}")
    click.echo(f"train with: edgert train {out_dir} --workers {','.join(placement.workers)} "
               f"--schedule {schedule} --micro-batches {micro_batches} --memory-mode {memory_mode}"
               + ("  (side by side, each stage with its threads: placement.json)" if side_by_side else "")
               + ("  (weight gradients once a step: placement.json)" if split_backward else ""))


def _has_weight_times(devices_path: Path) -> bool:
    """Whether ``edgert profile --split-backward`` measured a split backward's weight call on some device."""
    from edgert.devices import load_devices

    return any(t.weight_ms for device in load_devices(devices_path).devices for t in device.blocks)


def _devices_of(stage) -> str:
    """A stage's device, or its group's devices with their shares: ``pi-1 0.62 + pi-2 0.38``."""
    if not stage.devices:
        return stage.device
    return " + ".join(f"{device} {share:.2f}" for device, share in zip(stage.devices, stage.shares))
