"""``edgert evaluate`` and ``edgert predict``: use a trained model (board-side code only, no host extra)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgert.inference.evaluate import DEFAULT_BATCH, SPLITS, data_settings_for, evaluate, load_data
from edgert.inference.model import TrainedModel
from edgert.inference.predict import DEFAULT_TOP, predict
from edgert.models.data_settings import read_data_record
from edgert.progress import Progress
from edgert.scoring import LOSSES

PROGRESS_DELAY = 1.0  # seconds of work before a progress line shows
_model = click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
_run = click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                    help="A run folder (edgert train --out): its recorded data settings and class names.")
_batch = click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH, show_default=True,
                      help="Samples run at once.")
_threads = click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
                        help="onnxruntime intra-op threads (0: onnxruntime's choice).")
_json = click.option("--json", "as_json", is_flag=True, help="Print JSON (evaluate: one object; predict: one a line).")


@click.command("evaluate")
@_model
@click.option("--data", default=None,
              help="digits, tokens, a .npz, a .csv or a folder of images (docs/MODELS.md). Default: the data the "
                   "run trained on, as --run's data.json or the merged model records it.")
@_run
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="The split's seed (default: the run's, else 0).")
@click.option("--label-column", default=None, help="A CSV's column of labels (default: the run's, else label).")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True,
              help="Which samples to score: the run's test split, its training split, or both.")
@click.option("--loss", type=click.Choice(LOSSES), default=None,
              help="The loss to score (default: the model's edgert.loss, else cross_entropy).")
@_batch
@_threads
@_json
def evaluate_command(model: Path, data: str | None, run_dir: Path | None, seed: int | None, label_column: str | None,
                     split: str, loss: str | None, batch_size: int, threads: int, as_json: bool) -> None:
    trained = TrainedModel(model, threads)
    settings = data_settings_for(trained, data, run_dir, seed, label_column)
    reading = Progress(0, "reading data", delay=PROGRESS_DELAY)
    dataset = load_data(trained, settings, reading.follow)
    reading.close()
    scoring = Progress(0, "evaluating", delay=PROGRESS_DELAY)

    def show(done: int, total: int, score) -> None:
        scoring.total = total
        scoring.update(done, loss=score.mean_loss, accuracy=score.accuracy)

    result = evaluate(trained, dataset, split, batch_size, loss, show)
    scoring.close()
    if as_json:
        click.echo(json.dumps({**result.to_json(), "source": settings.source, "seed": settings.seed}))
        return
    accuracy = "" if result.accuracy is None else f", accuracy {result.accuracy:.4f}"
    click.echo(f"{model}: {result.split} split of {result.data} ({result.samples} samples, seed {settings.seed}): "
               f"{result.loss_name} loss {result.loss:.4f}{accuracy}")


@click.command("predict")
@_model
@click.argument("inputs", nargs=-1, required=True)
@click.option("--top", type=click.IntRange(min=1), default=DEFAULT_TOP, show_default=True,
              help="Classes shown per sample, most likely first.")
@_run
@_batch
@_threads
@_json
def predict_command(model: Path, inputs: tuple[str, ...], top: int, run_dir: Path | None, batch_size: int,
                    threads: int, as_json: bool) -> None:
    trained = TrainedModel(model, threads)
    classes = read_data_record(run_dir).classes if run_dir is not None else None
    for prediction in predict(trained, inputs, top, batch_size, classes):
        click.echo(json.dumps(prediction.to_json()) if as_json else prediction.line())
