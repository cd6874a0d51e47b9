"""``edgert bench <name>``: the benchmarks (edgert/bench/), the one command line of each.

A benchmark's options are its ``BenchConfig`` fields (declared with
:func:`edgert.bench.harness.option`: default and help written once); ``--json`` prints
its result, ``{"rows": [...], "ratios": {...}, ...}``, and progress goes to stderr. The
benchmark module is imported only when its command runs (or shows its help), so
``edgert --help`` and the board never import ``edgert.bench``. Add a benchmark to
:data:`BENCHMARKS`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import click

from edgert.cli.lazy_group import LazyGroup

if TYPE_CHECKING:
    from edgert.bench.harness import Option

# name: (needs the host extra, what it measures: the command's help and its line in `edgert bench --help`)
BENCHMARKS = {
    "transport": (False, "Raw TCP vs coap+tcp vs coap (UDP), large-message strategies and codecs."),
    "state": (False, "A stage state of 400 MB over coap+tcp in pieces (push and pull) vs raw TCP, memory."),
    "recovery": (True, "A SIGKILL mid-step on 4 local workers: recovery vs restart, replication's cost, accuracy."),
    "pipeline": (True, "edgert's overhead over bare ORT, and 1F1B's efficiency on 4 emulated devices."),
    "hetero": (True, "Planned cuts vs equal cuts vs the ideal on 1/2/5/10x devices, and live re-planning."),
    "gradients": (True, "edgert's gradient graphs vs the training build's (or other plans'), stage by stage."),
    "elastic": (True, "A device joins a run of slow devices mid-run: steps until it computes, the rate after."),
    "groups": (True, "Hybrid placements on 6 equal devices vs the best pipeline; speed-weighted vs equal shares."),
}


class _Benchmarks(LazyGroup):
    """The ``bench`` group: a command per entry of :data:`BENCHMARKS`, built from its module when asked for."""

    helps = {name: text for name, (_, text) in BENCHMARKS.items()}
    whole_lines = True  # each says what its benchmark measures

    def load(self, name: str) -> click.Command:
        if BENCHMARKS[name][0]:
            from edgert.cli.host import require_host_extra

            require_host_extra(f"bench {name}")
        return _command(name, importlib.import_module(f"edgert.bench.{name}"))


@click.group("bench", cls=_Benchmarks)
def bench() -> None:
    pass  # its help is its line in edgert.cli.COMMANDS


def _command(name: str, module: ModuleType) -> click.Command:
    """``edgert bench <name>``: the options of ``module.BenchConfig``, ``module.run``, ``module.format_table``."""
    config_type = module.BenchConfig
    fields = {f.name: f for f in dataclasses.fields(config_type)}

    def callback(as_json: bool, **values: Any) -> None:
        if "progress" in fields:
            from edgert.bench.harness import to_stderr

            values["progress"] = to_stderr
        config = config_type(**values)
        result = module.run(config)
        click.echo(json.dumps(result) if as_json else module.format_table(result))

    params: list[click.Parameter] = [click.Option(
        ["--json", "as_json"], is_flag=True, help='Print one JSON object {"rows": [...], "ratios": {...}, ...}.')]
    params += [_option(f) for f in fields.values() if _spec(f) is not None]
    return click.Command(name, callback=callback, params=params)


def _spec(field: dataclasses.Field) -> Option | None:
    """How ``field`` appears on the command line; None for a field that is no option (``progress``)."""
    from edgert.bench.harness import OPTION

    return field.metadata.get(OPTION)


def _option(field: dataclasses.Field) -> click.Option:
    """The click option of a config field: its flag, type, default and help, all from the field."""
    spec = _spec(field)
    flag = spec.flag or "--" + field.name.replace("_", "-")
    if isinstance(field.default, bool):
        return click.Option([f"{flag}/--no-{flag[2:]}", field.name], default=field.default, help=spec.help)
    if spec.choices:
        kind: Any = click.Choice(spec.choices)
    elif spec.parse:
        kind = _Parsed(spec.parse, flag)
    elif spec.type is Path:
        kind = click.Path(file_okay=False, path_type=Path)  # a benchmark's paths are folders it writes into
    else:
        kind = spec.type or type(field.default)
    default = spec.show(field.default) if spec.show else field.default  # as one would type it
    return click.Option([flag, field.name], type=kind, default=default, show_default=default is not None,
                        help=spec.help)


class _Parsed(click.ParamType):
    """A value read by the benchmark's own parser (a size list, a size), its ValueError a usage error."""

    def __init__(self, parse: Callable[[str], Any], flag: str):
        self.parse = parse
        self.name = flag[2:].upper()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):  # already converted (click may convert a value twice)
            return value
        try:
            return self.parse(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)
