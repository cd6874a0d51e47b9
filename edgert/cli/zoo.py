"""``edgert zoo list`` and ``edgert zoo build``: the models edgert ships builders for."""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgert.cli.host import require_host_extra
from edgert.cli.table import format_table, human_count


@click.group("zoo")
def zoo() -> None:
    pass  # its help is its line in edgert.cli.COMMANDS


@zoo.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_command(as_json: bool) -> None:
    """Names, parameters, FLOPs and input shape of every zoo model."""
    require_host_extra("zoo list")
    from edgert.exporter.export import ExportOptions, prepare_analysis
    from edgert.exporter.source import from_model_proto
    from edgert.models import build_model, list_models

    rows = []
    for spec in list_models():
        analysis = prepare_analysis(from_model_proto(build_model(spec.name), spec.name), ExportOptions())
        rows.append({
            "name": spec.name, "params": analysis.param_count, "flops_per_sample": analysis.total_flops,
            "input": f"{spec.input_dtype}{['N', *spec.input_shape]}", "blocks": len(analysis.blocks),
            "dataset": spec.dataset, "description": spec.description,
        })
    if as_json:
        click.echo(json.dumps({"models": rows}))
        return
    table = [(r["name"], human_count(r["params"]), human_count(r["flops_per_sample"]), r["input"], r["blocks"],
              r["dataset"]) for r in rows]
    click.echo(format_table(["name", "params", "FLOPs/sample", "input", "blocks", "data"], table))


@zoo.command("build")
@click.argument("name")
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the initial weights.")
def build_command(name: str, out_path: Path, seed: int) -> None:
    """Build zoo model NAME with seeded weights and save it as ONNX."""
    require_host_extra("zoo build")
    from edgert.models import build_model, get_model_spec, save_model

    spec = get_model_spec(name)
    save_model(build_model(name, seed=seed), out_path)
    click.echo(f"wrote {out_path}: {spec.name}, input {spec.input_name} {spec.input_dtype}"
               f"{['N', *spec.input_shape]}, labels {spec.label_dtype}{['N', *spec.label_shape]}, "
               f"{spec.num_classes} classes")
