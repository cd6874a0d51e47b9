"""A click group that lists its commands from a table and imports a command's code only when that command runs.

``edgert --help`` and ``edgert bench --help`` list every command without importing one, so what a
command imports (the coordinator, onnx, a benchmark) is loaded, and needed, only by that command:
``edgert worker`` on a board loads the worker's code alone (tests/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import click


class LazyGroup(click.Group):
    """A group whose commands are a table, name: help; :meth:`load` makes one when it runs or shows its help.

    A command's help is its line in the table, stated there only: the group's ``--help`` lists it
    (shortened as click shortens a command's help, unless :attr:`whole_lines`) and the command's
    own ``--help`` shows it whole.
    """

    helps: Mapping[str, str] = {}
    whole_lines = False

    def load(self, name: str) -> click.Command:
        """The command ``name`` (a key of :attr:`helps`), its code imported now."""
        raise NotImplementedError

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.helps)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.helps:
            return None
        command = self.load(name)
        command.help = self.helps[name]
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in self.helps)
        with formatter.section("Commands"):
            formatter.write_dl([(name, self._line(name, limit)) for name in self.helps])

    def _line(self, name: str, limit: int) -> str:
        text = self.helps[name]
        return text if self.whole_lines else click.Command(name, help=text).get_short_help_str(limit)
