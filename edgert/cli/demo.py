"""``edgert demo``: the whole product on this machine, in one command."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from edgert.cli.host import require_host_extra
from edgert.coordinator.coordinator import TrainConfig
from edgert.schedule import SCHEDULES


def _say(text: str) -> None:
    click.echo(text, err=True)


@click.command("demo")
@click.option("--model", default="cnn", show_default=True, help="Zoo model to build and train.")
@click.option("--stages", type=int, default=4, show_default=True, help="Stages, one local worker each.")
@click.option("--epochs", type=int, default=8, show_default=True)
@click.option("--batch-size", type=int, default=TrainConfig.batch_size, show_default=True)
@click.option("--micro-batches", type=int, default=TrainConfig.micro_batches, show_default=True)
@click.option("--schedule", type=click.Choice(SCHEDULES), default=TrainConfig.schedule, show_default=True)
@click.option("--lr", "learning_rate", type=float, default=3e-3, show_default=True)
@click.option("--slowdowns", default=None, help="Emulated slowdown per worker, e.g. 1,2,5,10.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run folder; default a new runs/demo-<date>-<n>. A folder that holds a run is refused.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary object on stdout.")
def demo_command(model: str, stages: int, epochs: int, batch_size: int, micro_batches: int, schedule: str,
                 learning_rate: float, slowdowns: str | None, out_dir: Path | None, as_json: bool) -> None:
    require_host_extra("demo")
    from edgert.cli.train import print_summary
    from edgert.coordinator.coordinator import TrainConfig, train
    from edgert.coordinator.localcluster import LocalCluster
    from edgert.coordinator.runlog import holds_run, new_run_folder
    from edgert.exporter.export import ExportOptions, export_plan
    from edgert.manifest import TrainingConfig
    from edgert.models import build_model, get_model_spec, save_model
    from edgert.security.keystore import local_cluster_keys

    spec = get_model_spec(model)
    speeds = [s.strip() for s in slowdowns.split(",")] if slowdowns else None
    if speeds is not None and len(speeds) != stages:
        raise click.UsageError(f"--slowdowns gives {len(speeds)} values for {stages} stages")
    if out_dir is None:
        out_dir = new_run_folder(prefix="demo-")
    if holds_run(out_dir):
        raise click.UsageError(f"--out {out_dir} already holds a run; choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / f"{model}.onnx"
    save_model(build_model(model), model_path)
    _say(f"[1/3] built {model} -> {model_path}")
    plan = out_dir / "plan"
    training = TrainingConfig(learning_rate=learning_rate)
    export_plan(model_path, plan, ExportOptions(stages=stages, training=training))
    _say(f"[2/3] exported {stages} stages -> {plan}")
    names = [f"local-{k}" for k in range(stages)]
    with tempfile.TemporaryDirectory(prefix="edgert-demo-keys-") as keys:
        credentials = local_cluster_keys(Path(keys), names, cluster="demo")
        with LocalCluster(stages, slowdowns=speeds, names=names, log_dir=out_dir / "worker-logs",
                          credentials=credentials) as cluster:
            _say(f"[3/3] training on {stages} local workers (mutual TLS, a throw-away cluster identity): "
                 f"{', '.join(cluster.urls)}")
            config = TrainConfig(plan_dir=plan, workers=tuple(cluster.urls), out_dir=out_dir, data=spec.dataset,
                                 epochs=epochs, batch_size=batch_size, micro_batches=micro_batches,
                                 schedule=schedule, listen="coaps+tcp://127.0.0.1:0", keys=Path(keys) / "cluster")
            summary = train(config)
    print_summary(summary, as_json)
    if not as_json:
        click.echo(f"metrics: {out_dir / 'metrics.jsonl'}  trace (Perfetto): {out_dir / 'trace.json'}  "
                   f"merge: edgert merge {out_dir} -o trained.onnx")
