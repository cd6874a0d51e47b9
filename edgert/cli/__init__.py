"""The ``edgert`` command line: thin click commands over library functions.

Each module here registers one family of commands on :data:`main`:

- ``zoo.py``       ``edgert zoo list|build``          (host)
- ``export.py``    ``edgert export|inspect|check``    (host)
- ``bench.py``     ``edgert bench ...``               (host)
- ``runtime.py``   ``edgert worker``, ``edgert train`` (the runtime; no host extra needed for worker)
- ``demo.py``      ``edgert demo``                    (host)
- ``keys.py``      ``edgert keys init|enroll|revoke|list`` (host), ``keys import`` (board); security options
- ``doctor.py``    ``edgert doctor``                   (board: is this device ready to be a worker)

Host commands import ``edgert.exporter`` / ``edgert.models`` inside the command body, so a
board without the ``host`` extra can still run the runtime commands.
"""

from __future__ import annotations

import sys

import click

from edgert.errors import EdgertError


class _Group(click.Group):
    """A click group that prints an :class:`EdgertError` as one line, not a traceback."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except EdgertError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="edgert")
def main() -> None:
    """edgert: train one network across several weak, unequal edge devices."""


def _register_commands() -> None:
    from edgert.cli import bench, demo, doctor, export, keys, runtime, zoo  # noqa: F401  (each registers itself on main)


_register_commands()
