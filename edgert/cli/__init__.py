"""The ``edgert`` command line: thin click commands over library functions.

Map: each command module registers one family of commands on :data:`main`.

- ``runtime.py``   ``edgert worker|train|profile``: the runtime (``worker`` needs no host extra)
- ``doctor.py``    ``edgert doctor``: is this board ready to be a worker
- ``keys.py``      ``edgert keys init|enroll|revoke|list`` (host), ``keys import`` (board); the security options
- ``export.py``    ``edgert export|inspect|check|merge|plan`` (host)
- ``zoo.py``       ``edgert zoo list|build`` (host)
- ``demo.py``      ``edgert demo`` (host)
- ``bench.py``     ``edgert bench ...`` (host)
- ``params.py``    option types that check URLs and codec specs with the library's own parsers
- ``host.py``      the check host-only commands run first: is the ``host`` extra installed
- ``table.py``     the plain-text tables and sizes the commands print

Every error a user can fix ends the command with one ``error:`` line on stderr and a
non-zero exit code (2: edgert's errors and bad options, 1: the operating system refused);
anything else is a bug and shows its traceback.

Host commands import ``edgert.exporter`` / ``edgert.models`` inside the command body, so a
board without the ``host`` extra can still run the runtime commands (tests/test_architecture.py
checks what ``edgert worker`` loads).
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from edgert.errors import EdgertError


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


@click.group(cls=_Group)
@click.version_option(package_name="edgert")
def main() -> None:
    """edgert: train one network across several weak, unequal edge devices."""


def _register_commands() -> None:
    from edgert.cli import bench, demo, doctor, export, keys, runtime, zoo  # noqa: F401  (each registers itself on main)


_register_commands()
