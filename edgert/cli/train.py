"""``edgert train``: the central node; its options' defaults are those of ``TrainConfig`` (and ``RunSettings``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgert.cli.keys import INSECURE_WARNING, check_listen, default_listen, host_keys
from edgert.cli.params import CoapUrl, CoapUrlList, CodecSpec, log_level_option, start_logging
from edgert.coordinator.coordinator import REPLAN_MODES, TrainConfig, resumed_config, train
from edgert.coordinator.runlog import new_run_folder
from edgert.manifest import MEMORY_MODES
from edgert.run_settings import RunSettings
from edgert.schedule import SCHEDULES


@click.command("train")
@click.argument("plan", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--workers", type=CoapUrlList(), default=None, help="Worker URLs in stage order, comma-separated.")
@click.option("--data", default=TrainConfig.data, show_default=True,
              help="digits, tokens, a .npz (x, y[, x_test, y_test, classes]), a .csv of features with a label "
                   "column, or a folder of images in class subfolders (docs/MODELS.md).")
@click.option("--label-column", default=TrainConfig.label_column, show_default=True,
              help="A CSV's column of labels (class indices or names).")
@click.option("--epochs", type=int, default=TrainConfig.epochs, show_default=True)
@click.option("--steps", type=int, default=TrainConfig.steps, help="Stop after this many optimizer steps.")
@click.option("--batch-size", type=int, default=TrainConfig.batch_size, show_default=True)
@click.option("--micro-batches", type=int, default=TrainConfig.micro_batches, show_default=True)
@click.option("--schedule", type=click.Choice(SCHEDULES), default=TrainConfig.schedule, show_default=True)
@click.option("--lr", "learning_rate", type=float, default=TrainConfig.learning_rate,
              help="Override the plan's learning rate.")
@click.option("--seed", type=int, default=TrainConfig.seed, show_default=True)
@click.option("--codec", type=CodecSpec(), default=TrainConfig.forward_codec,
              help="Codec for activations on every link: none, fp16, int8, int4 (int8:axis=1: per channel). "
                   "Given, it overrides the per-link codecs of the plan's placement.json (edgert plan); "
                   f"default: the plan's, else {RunSettings.forward_codec}.")
@click.option("--grad-codec", type=CodecSpec(), default=TrainConfig.backward_codec,
              help="Codec for gradients on every link: none, fp16, int8, int4, topk:RATIO (e.g. topk:0.01) or "
                   "topk:k=N. Given, it overrides the plan's per-link codecs; default: the plan's (a link's "
                   f"gradients go in its activations' codec), else {RunSettings.backward_codec}.")
@click.option("--threads", type=click.IntRange(min=1), default=TrainConfig.forward_threads, show_default=True,
              help="ORT intra-op threads of each worker's forward session (and of its backward session, unless "
                   "--backward-threads).")
@click.option("--backward-threads", type=click.IntRange(min=1), default=None,
              help="ORT intra-op threads of each worker's backward session (default: --threads).")
@click.option("--side-by-side/--one-after-the-other", default=TrainConfig.side_by_side,
              help="Run each stage's forwards on a thread of their own, beside its backwards (1F1B and GPipe; "
                   "stages without BatchNorm): for workers with a core for each session's threads. Default: as "
                   "the plan was made (edgert plan --side-by-side), each worker then with the threads the plan "
                   "split for it; else one after the other.")
@click.option("--split-backward/--whole-backward", default=TrainConfig.split_backward,
              help="Compute each stage's parameter gradients once a step, over all its micro-batches, after the "
                   "gradients its neighbour waits for (zero-bubble pipelines' B/W split): shorter backwards on the "
                   "pipeline's path, for the memory of the step's activations. Stages the plan split only (not "
                   "the first: nothing waits for its backward). Default: as the plan was made (edgert plan "
                   "--split-backward), else whole.")
@click.option("--memory-mode", type=click.Choice(MEMORY_MODES), default=TrainConfig.memory_mode, show_default=True,
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
@click.option("--step-timeout", type=float, default=TrainConfig.step_timeout, show_default=True)
@click.option("--replan", type=click.Choice(REPLAN_MODES), default=TrainConfig.replan, show_default=True,
              help="Move the cuts while training when measured stage times drift.")
@click.option("--replan-every", type=int, default=TrainConfig.replan_every, show_default=True,
              help="Steps between re-planning checks.")
@click.option("--replan-threshold", type=float, default=TrainConfig.replan_threshold, show_default=True,
              help="Re-plan only for a predicted speed-up above this fraction.")
@click.option("--replan-groups/--no-replan-groups", default=TrainConfig.replan_groups,
              help="Let a live re-plan, a recovery that re-cuts and --resume form, grow, shrink or re-form "
                   "data-parallel groups (a joining worker may join a group without a re-cut). Default: for "
                   "models without BatchNorm, where a group trains exactly as one device.")
@click.option("--replan-at", multiple=True, help='Force a re-plan before a step: "STEP" or "STEP:CUT,CUT" (block '
              "indices). Repeatable.")
@click.option("--devices", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="devices.json from `edgert profile`, for re-planning.")
@click.option("--replicate-every", type=int, default=TrainConfig.replicate_every, show_default=True,
              help="Steps between each stage's copies to the next workers (0: off).")
@click.option("--central-every", type=int, default=TrainConfig.central_every, show_default=True,
              help="Steps between copies to this coordinator, kept on disk (0: off).")
@click.option("--replicas", type=int, default=TrainConfig.replicas, show_default=True,
              help="Neighbours each stage's copy goes to.")
@click.option("--resume", "resume_run", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue the run in this folder, and record there, from its newest snapshot "
                   "(PLAN and options come from it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary object on stdout.")
@log_level_option
def train_command(plan: Path, workers: tuple[str, ...] | None, data: str, label_column: str, epochs: int,
                  steps: int | None, batch_size: int, micro_batches: int, schedule: str, learning_rate: float | None,
                  seed: int,
                  codec: str | None, grad_codec: str | None, threads: int, backward_threads: int | None,
                  side_by_side: bool | None, split_backward: bool | None, memory_mode: str, out_dir: Path | None,
                  overwrite: bool,
                  listen: str | None, keys: Path | None,
                  insecure: bool, advertise: str | None,
                  step_timeout: float, replan: str, replan_every: int, replan_threshold: float,
                  replan_groups: bool | None, replan_at: tuple[str, ...], devices: Path | None, replicate_every: int,
                  central_every: int,
                  replicas: int, resume_run: Path | None, as_json: bool, log_level: str) -> None:
    start_logging(log_level)
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
    check_listen(listen, keys is not None)
    forced = tuple(_forced_replan(text) for text in replan_at)  # a bad one is refused before a folder is made
    chosen = out_dir is None
    if chosen:
        out_dir = new_run_folder()
        click.echo(f"run folder: {out_dir}", err=True)
    config = TrainConfig(
        plan_dir=plan, workers=workers, out_dir=out_dir,
        data=data, label_column=label_column, epochs=epochs, steps=steps, batch_size=batch_size,
        micro_batches=micro_batches,
        schedule=schedule, learning_rate=learning_rate, seed=seed, forward_codec=codec, backward_codec=grad_codec,
        forward_threads=threads, backward_threads=backward_threads or threads, side_by_side=side_by_side,
        split_backward=split_backward, listen=listen or default_listen(keys is not None, 0),
        keys=keys, advertise=advertise,
        step_timeout=step_timeout, replan=replan, replan_every=replan_every, replan_threshold=replan_threshold,
        replan_at=forced, replan_groups=replan_groups, devices=devices, memory_mode=memory_mode,
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
    if any(link[d] != "none" for link in summary.links for d in ("forward", "backward")):
        for link in summary.links:
            click.echo(f"  link {link['link']} ({link['sender']} -> {link['receiver']}): activations "
                       f"{link['forward']}, gradients {link['backward']}")
