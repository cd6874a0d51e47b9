"""Hypothesis strategies for bad request bodies, shared by the worker's and the coordinator's fuzz tests.

A bad request is wrong for one reason: a method the resource does not have, a payload on a
``GET``, or a body of one *kind*: none, random bytes, other CBOR, another Content-Format,
an envelope of another kind, one of another run, or (``content``, built by each test for
its resource) the resource's own envelope with exactly one thing wrong.
"""

from __future__ import annotations

import cbor2
import numpy as np
from hypothesis import strategies as st

METHODS = ("GET", "POST", "PUT", "DELETE", "FETCH")
BODY_KINDS = ("none", "bytes", "cbor", "format", "kind", "run", "content", "content", "content", "content")
ENVELOPE_KINDS = ("stage", "control", "batch", "weights", "activations", "gradients", "report", "health")

scalars = (st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12))

WRONG_VALUES = {int: [None, True, -1, 1.5, "x", b"\x00", [], {}], str: [None, 5, 1.5, b"\x00", [], {}],
                list: [None, 5, "x", {}, [1, "a"], [None]], dict: [None, 5, "x", [], {"a": 1}],
                bool: [None, 5, "x", [], {}], float: [None, True, -1, 0, "x", [], {}]}
"""Values of the wrong type or range for a field whose right value has this type (floats: positive)."""


def envelope_bytes(kind: str, run_id: str, step: int = 0, microbatch: int = 0, stage: int = 1,
                   tensors: dict | None = None, meta: dict | None = None) -> bytes:
    """An envelope as CBOR, built by hand so that any field may hold anything."""
    item = {"v": 1, "kind": kind, "run_id": run_id, "step": step, "microbatch": microbatch, "stage": stage,
            "tensors": {name: cbor2.CBORTag(40, [list(a.shape), cbor2.CBORTag(85 if a.dtype == np.float32 else 64,
                                                                               a.tobytes())])
                        for name, a in (tensors or {}).items()}}
    if meta is not None:
        item["meta"] = meta
    return cbor2.dumps(item)


def broken(draw, template: dict, optional: tuple[str, ...] = (), wrong: dict | None = None) -> dict:
    """``template`` with one required field deleted, or one field given a value of the wrong type or range
    (``wrong``: the wrong values by field name, else :data:`WRONG_VALUES` by the right value's type)."""
    meta = dict(template)
    key = draw(st.sampled_from(sorted(meta)))
    if key not in optional and draw(st.booleans()):
        del meta[key]
    else:
        choices = (wrong or {}).get(key) or WRONG_VALUES[type(meta[key])]
        meta[key] = draw(st.sampled_from(choices))
    return meta


def misrouted(draw, allowed: tuple[str, ...]) -> tuple[str, bytes | None, int | None]:
    """(method, payload, Content-Format): a method the resource does not have (4.05), or a ``GET`` with a
    payload (4.00); or an allowed method with payload None: the body must be wrong then."""
    method = draw(st.sampled_from(METHODS))
    if method not in allowed:
        return method, draw(st.binary(max_size=40)), None
    if method == "GET":
        return method, draw(st.binary(min_size=1, max_size=60)), draw(st.sampled_from([None, 60, 0]))
    return method, None, None


def generic_body(draw, body: str, own_kind: str, run_id: str) -> tuple[bytes, int | None]:
    """(payload, Content-Format) of a generic body kind: anything in :data:`BODY_KINDS` but ``content``."""
    if body == "none":
        return b"", None
    if body == "bytes":
        return draw(st.binary(min_size=1, max_size=200)), None
    if body == "cbor":
        return cbor2.dumps(draw(scalars | st.lists(scalars, max_size=4)
                                | st.dictionaries(st.text(max_size=6), scalars, max_size=4))), None
    if body == "format":
        return draw(st.binary(max_size=60)), draw(st.sampled_from([0, 50, 11542]))
    if body == "kind":
        other = draw(st.sampled_from([k for k in ENVELOPE_KINDS if k != own_kind]))
        return envelope_bytes(other, run_id), None
    if body == "run":
        return envelope_bytes(own_kind, draw(st.sampled_from(["", "other", run_id + "2"]))), None
    raise ValueError(f"{body!r} is the resource's own business")
