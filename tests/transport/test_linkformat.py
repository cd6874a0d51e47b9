"""RFC 6690 link format: render, parse, filter."""

import pytest

from edgert.transport.linkformat import Link, matches, parse, render


def test_render_and_parse_round_trip():
    links = [
        Link("/stage/1/activations", (("rt", "edgert.activations"), ("ct", "60"))),
        Link("/health", (("rt", "edgert.health"), ("obs", None), ("title", 'say "hi", ok; yes'))),
    ]
    text = render(links)
    assert text.startswith('</stage/1/activations>;rt="edgert.activations";ct=60,</health>')
    assert parse(text) == links
    assert parse(text)[1].observable and parse(text)[0].ct == (60,) and parse(text)[0].rt == ("edgert.activations",)


def test_parse_accepts_foreign_spacing_and_tokens():
    links = parse(' </a>;rt=x.y;ct="0 60" , </b>;obs')
    assert links[0].rt == ("x.y",) and links[0].ct == (0, 60) and links[1].observable


@pytest.mark.parametrize("text, message", [
    ("/a>", "expected '<'"), ("</a", "unterminated '<'"), ('</a>;rt="x', "unterminated quoted"),
    ("</a>;=1", "empty attribute name"), ("</a> </b>", "expected ',' or ';'"),
])
def test_parse_errors_name_the_position(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_query_filters():
    link = Link("/stage/1/weights", (("rt", "edgert.weights edgert.replica"), ("ct", "60")))
    assert matches(link, {"rt": "edgert.replica"}) and matches(link, {"rt": "edgert.w*"})
    assert matches(link, {"href": "/stage/*"}) and matches(link, {"ct": "60"})
    assert not matches(link, {"rt": "edgert.health"}) and not matches(link, {"if": "x"})
