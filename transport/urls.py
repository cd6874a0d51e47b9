"""edgert URLs: ``coap+tcp://``, ``coaps+tcp://`` and ``coap://host:port``, parsed in this one place.

Servers bind them, clients and the coordinator reach peers by them, and the command line
checks each ``--listen``, ``--workers`` and ``--join`` with :func:`parse_url` before it starts
anything, so a bad URL is one :class:`~edgert.transport.errors.InvalidUrl` naming it.
"""

from __future__ import annotations

import urllib.parse

from edgert.transport.coap_tcp import DEFAULT_PORT, TLS_SCHEME
from edgert.transport.errors import InvalidUrl

SCHEMES = ("coap+tcp", TLS_SCHEME, "coap")


def parse_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``coap+tcp://``, ``coaps+tcp://`` or ``coap://host:port``; raises InvalidUrl.

    Without a port the URL means :data:`~edgert.transport.coap_tcp.DEFAULT_PORT`, whatever the scheme.
    """
    if not isinstance(url, str):
        raise InvalidUrl(f"URL {url!r} is not a string")
    if "://" not in url:
        raise InvalidUrl(f"URL {url!r} has no scheme: write {TLS_SCHEME}://{url} "
                         f"(or coap+tcp://{url} for a worker started with --insecure)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise InvalidUrl(f"URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")
    if not parts.hostname:
        raise InvalidUrl(f"URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError:
        raise InvalidUrl(f"URL {url!r} has an invalid port (0 to 65535)") from None
    return parts.scheme, parts.hostname, DEFAULT_PORT if port is None else port


def format_url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port`` with IPv6 literals in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
