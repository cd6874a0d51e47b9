"""The ``edgert`` command line: thin click commands over library functions.

Map: :data:`COMMANDS` names each command's module and help; ``main`` imports a module only when
one of its commands runs or shows its help (:mod:`.lazy_group`), so each command loads its own room.

- ``worker.py``     ``edgert worker``: the on-device runtime (board-side code only, no host extra)
- ``doctor.py``     ``edgert doctor``: is this board ready to be a worker
- ``inference.py``  ``edgert evaluate|predict``: use a trained model (board-side code only, no host extra)
- ``train.py``      ``edgert train``: the central node, its options' defaults those of ``TrainConfig``
- ``profile.py``    ``edgert profile``: measure the workers and their links for the planner (host)
- ``keys.py``       ``edgert keys init|enroll|revoke|list`` (host), ``keys import`` (board); the security options
- ``export.py``     ``edgert export|inspect|check|merge|plan`` (host)
- ``zoo.py``        ``edgert zoo list|build`` (host)
- ``demo.py``       ``edgert demo`` (host)
- ``bench.py``      ``edgert bench ...`` (host)
- ``lazy_group.py`` the click group that lists commands from a table and imports one only when it runs
- ``params.py``     option types that check URLs and codec specs with the library's own parsers; ``--log-level``
- ``host.py``       the check host-only commands run first: is the ``host`` extra installed
- ``table.py``      the plain-text tables and sizes the commands print

Every error a user can fix ends the command with one ``error:`` line on stderr and a
non-zero exit code (2: edgert's errors and bad options, 1: the operating system refused);
anything else is a bug and shows its traceback.

A board without the ``host`` extra can still run the runtime commands: host commands check for
it first and import ``edgert.exporter`` / ``edgert.models`` inside the command body
(tests/test_architecture.py checks what ``edgert worker`` loads).
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

import click

from edgert.cli.lazy_group import LazyGroup
from edgert.errors import EdgertError

# name: (its module in edgert/cli/, its help: the line `edgert --help` lists, in this order, without importing it)
COMMANDS = {
    "bench": ("bench", "Measure edgert's subsystems (loopback, this machine)."),
    "check": ("export", "Train PLAN's stages chained in one process and compare with the unsplit model."),
    "demo": ("demo", "Build a zoo model, cut it into stages, train it on local workers, report."),
    "doctor": ("doctor", "Check that this device can run 'edgert worker'; exit 1 if anything FAILs."),
    "evaluate": ("inference", "Score MODEL (a merged run) on a data set: loss and accuracy on the run's test split."),
    "export": ("export", "Cut MODEL into pipeline stages and build their ORT training artifacts."),
    "inspect": ("export", "Show a plan folder's stages, or an ONNX model's blocks and legal cuts."),
    "keys": ("keys", "The cluster identity: create it, enrol and revoke devices (docs/SECURITY.md)."),
    "merge": ("export", "Stitch RUN's trained stages back into one ONNX model, ready to serve."),
    "plan": ("export", "Cut MODEL for the devices DEVICES measured: cuts, device order, codecs, threads; export "
                       "the plan."),
    "predict": ("inference", "Top classes of MODEL for the samples in INPUTS (.npy, .npz, image files)."),
    "profile": ("profile", "Measure each worker on MODEL's units (forward, backward, memory) and every link "
                           "between workers."),
    "train": ("train", "Train PLAN across WORKERS (one per stage) and record the run."),
    "worker": ("worker", "Run the on-device runtime: serve CoAP, train whatever stage the coordinator assigns."),
    "zoo": ("zoo", "The model zoo: small ONNX models built locally with seeded weights."),
}


class _Group(click.Group):
    """A click group that prints what a user can fix as one ``error:`` line, not a traceback.

    That is edgert's error family (:class:`EdgertError`, transport errors included), an
    ``OSError`` (a port in use, a folder that cannot be written) and click's own usage errors;
    any other exception is a bug and keeps its traceback.
    """

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except click.UsageError as error:
            command = error.ctx.command_path if error.ctx is not None else ctx.command_path
            _fail(f"{error.format_message()} (see {command} --help)", error.exit_code)
        except click.ClickException as error:
            _fail(error.format_message(), error.exit_code)
        except EdgertError as error:
            _fail(str(error), 2)
        except OSError as error:
            _fail(_os_error_line(error), 1)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(code)


def _os_error_line(error: OSError) -> str:
    """An OSError as ``path: reason``, the form the shell uses."""
    reason = error.strerror or str(error)
    if error.filename is None:
        return reason
    if error.filename2 is not None:
        return f"{error.filename} -> {error.filename2}: {reason}"
    return f"{error.filename}: {reason}"


class _Main(LazyGroup, _Group):
    """``edgert``: the commands of :data:`COMMANDS`, each imported from its module when it runs."""

    helps = {name: text for name, (_, text) in COMMANDS.items()}

    def load(self, name: str) -> click.Command:
        """The click command named ``name`` in the module :data:`COMMANDS` gives."""
        module = importlib.import_module(f"edgert.cli.{COMMANDS[name][0]}")
        return next(command for command in vars(module).values()
                    if isinstance(command, click.Command) and command.name == name)


@click.group(cls=_Main)
@click.version_option(package_name="edgert")
def main() -> None:
    """edgert: train one network across several weak, unequal edge devices."""
