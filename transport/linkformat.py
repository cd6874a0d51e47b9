"""RFC 6690 CoRE link format: what ``/.well-known/core`` returns, rendered and parsed.

Example: ``</stage/1/activations>;rt="edgert.activations";ct=60,</health>;rt="edgert.health";obs``.
Kept small and strict so devices in other languages can produce and read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Content-Format of application/link-format.
CONTENT_FORMAT = 40

_TOKEN_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~")


@dataclass(frozen=True)
class Link:
    """One link: a target path and its attributes in order (value None for a bare attribute like ``obs``)."""

    href: str
    attrs: tuple[tuple[str, str | None], ...] = ()

    def get(self, name: str) -> str | None:
        """The first value of attribute ``name`` ('' for a bare attribute), or None if absent."""
        for key, value in self.attrs:
            if key == name:
                return "" if value is None else value
        return None

    @property
    def rt(self) -> tuple[str, ...]:
        """Resource types (space-separated in ``rt``)."""
        value = self.get("rt")
        return tuple(value.split()) if value else ()

    @property
    def ct(self) -> tuple[int, ...]:
        """Content-Formats the resource offers."""
        value = self.get("ct")
        return tuple(int(v) for v in value.split() if v.isdigit()) if value else ()

    @property
    def observable(self) -> bool:
        """Whether the resource is marked observable (``obs``)."""
        return self.get("obs") is not None

    def __str__(self) -> str:
        parts = [f"<{self.href}>"]
        for key, value in self.attrs:
            if value is None:
                parts.append(key)
            elif value and all(c in _TOKEN_CHARS for c in value) and key in ("ct", "sz"):
                parts.append(f"{key}={value}")
            else:
                escaped = value.replace("\\", "\\\\").replace('"', '\\"')
                parts.append(f'{key}="{escaped}"')
        return ";".join(parts)


def render(links: Iterable[Link]) -> str:
    """The link-format document for ``links``."""
    return ",".join(str(link) for link in links)


def parse(text: str) -> list[Link]:
    """Parse a link-format document; raises ValueError with the offending position."""
    links: list[Link] = []
    pos, end = 0, len(text)
    while pos < end:
        pos = _skip_space(text, pos)
        if text[pos : pos + 1] != "<":
            raise ValueError(f"link format: expected '<' at {pos}, found {text[pos:pos + 10]!r}")
        close = text.find(">", pos)
        if close < 0:
            raise ValueError(f"link format: unterminated '<' at {pos}")
        href = text[pos + 1 : close]
        pos = close + 1
        attrs: list[tuple[str, str | None]] = []
        while pos < end and text[pos] == ";":
            pos, attr = _parse_param(text, pos + 1)
            attrs.append(attr)
        links.append(Link(href, tuple(attrs)))
        pos = _skip_space(text, pos)
        if pos < end:
            if text[pos] != ",":
                raise ValueError(f"link format: expected ',' or ';' at {pos}, found {text[pos:pos + 10]!r}")
            pos += 1
    return links


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _parse_param(text: str, pos: int) -> tuple[int, tuple[str, str | None]]:
    start = pos
    while pos < len(text) and text[pos] not in "=;,":
        pos += 1
    name = text[start:pos].strip()
    if not name:
        raise ValueError(f"link format: empty attribute name at {start}")
    if pos >= len(text) or text[pos] != "=":
        return pos, (name, None)
    pos += 1
    if pos < len(text) and text[pos] == '"':
        pos += 1
        value = []
        while True:
            if pos >= len(text):
                raise ValueError(f"link format: unterminated quoted value for {name!r}")
            char = text[pos]
            if char == "\\" and pos + 1 < len(text):
                value.append(text[pos + 1])
                pos += 2
            elif char == '"':
                return pos + 1, (name, "".join(value))
            else:
                value.append(char)
                pos += 1
    start = pos
    while pos < len(text) and text[pos] not in ";,":
        pos += 1
    return pos, (name, text[start:pos].strip())


def matches(link: Link, filters: dict[str, str]) -> bool:
    """RFC 6690 section 4.1 query filtering: each ``name=value`` must match (``value*`` = prefix)."""
    for name, wanted in filters.items():
        prefix = wanted.endswith("*")
        wanted = wanted[:-1] if prefix else wanted
        if name == "href":
            candidates = [link.href]
        else:
            value = link.get(name)
            if value is None:
                return False
            candidates = value.split() if name in ("rt", "if", "ct") else [value]
        if not any(c.startswith(wanted) if prefix else c == wanted for c in candidates):
            return False
    return True
