"""Option types that check a value with the library's own parser before a command starts.

A URL goes through :func:`edgert.transport.urls.parse_url` and a codec spec through
:func:`edgert.transport.codec.get_codec` (the parser the worker uses too), so the command
line refuses exactly what the runtime would, in one line naming the option. ``--log-level`` is
the option the long-running commands (``worker``, ``train``) share.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click


class CoapUrl(click.ParamType):
    """One ``coap+tcp://``, ``coaps+tcp://`` or ``coap://`` URL, kept as written."""

    name = "URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from edgert.transport.urls import parse_url

        try:
            parse_url(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)
        return value


class CoapUrlList(CoapUrl):
    """Comma-separated URLs, each checked; returned as a tuple of them, in order."""

    name = "URL,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, ...]:
        if isinstance(value, tuple):  # already converted (click may convert a value twice)
            return value
        urls = tuple(url.strip() for url in str(value).split(",") if url.strip())
        if not urls:
            self.fail("no URL given", param, ctx)
        for url in urls:
            super().convert(url, param, ctx)
        return urls


class CodecSpec(click.ParamType):
    """A tensor codec spec (``int8``, ``int8:axis=1``, ``topk:0.01``...), returned in its canonical form."""

    name = "CODEC"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from edgert.transport.codec import get_codec

        try:
            return get_codec(value).spec
        except ValueError as error:
            self.fail(str(error), param, ctx)


log_level_option = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
                                default="warning")


def start_logging(level: str) -> None:
    """Log to stderr from ``level`` (``--log-level``) up."""
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
