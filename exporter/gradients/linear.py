"""Gradient rules of matrix products: MatMul (any ranks, broadcasting), Gemm, Einsum.

A weight shared by every row (``(..., K) @ (K, N)``, a Linear layer) gets its gradient from one
``Gemm`` over the flattened rows instead of a batched product summed afterwards.
"""

from __future__ import annotations

import re

from edgert.exporter.gradients.broadcast import sum_to
from edgert.exporter.gradients.registry import GradientContext, gradient
from edgert.exporter.graph_writer import TensorType


def _swap_last(c: GradientContext, x: str, rank: int) -> str:
    return c.writer.op("Transpose", [x], perm=[*range(rank - 2), rank - 1, rank - 2])


@gradient("MatMul", inputs=(0, 1))
def matmul(c: GradientContext) -> dict[int, str]:
    """dA = dY B^T, dB = A^T dY, each summed over the batch axes its operand was broadcast along; a 1-D operand
    first gains the axis numpy gives it."""
    w, dy, y = c.writer, c.dy(), c.output(0)
    a, b = c.input(0), c.input(1)
    ra, rb = c.rank(a), c.rank(b)
    result = {}
    if c.wants(1) and rb == 2 and ra >= 2:
        result[1] = _shared_weight_gradient(c, a, dy, ra)
    if not (c.wants(0) or (c.wants(1) and 1 not in result)):
        return result
    a2, b2, dy2 = _as_matrices(c, a, b, dy, ra, rb)
    batch = c.type_of(y).shape[:len(c.type_of(y).shape) - (ra > 1) - (rb > 1)]
    if c.wants(0):
        da = w.op("MatMul", [dy2, _swap_last(c, b2, max(rb, 2))])
        c.types[da] = TensorType(c.type_of(a).elem_type, (*batch, *c.type_of(a2).shape[-2:]))
        result[0] = _back_to(c, sum_to(c, da, a2, da), a, ra)
    if c.wants(1) and 1 not in result:
        db = w.op("MatMul", [_swap_last(c, a2, max(ra, 2)), dy2])
        c.types[db] = TensorType(c.type_of(b).elem_type, (*batch, *c.type_of(b2).shape[-2:]))
        result[1] = _back_to(c, sum_to(c, db, b2, db), b, rb)
    return result


def _shared_weight_gradient(c: GradientContext, a: str, dy: str, ra: int) -> str:
    """(..., K) @ (K, N): dW = rows(A)^T rows(dY), one Gemm over every row."""
    w = c.writer
    if ra == 2:
        return w.op("Gemm", [a, dy], transA=1)
    return w.op("Gemm", [_rows(c, a, a), _rows(c, dy, c.output(0))], transA=1)


def _rows(c: GradientContext, x: str, like: str) -> str:
    """``x`` as a matrix of its last axis' length (``like`` is the forward tensor shaped as ``x``)."""
    w = c.writer
    last = c.type_of(like).shape[-1]
    if isinstance(last, int):
        return w.reshape(x, [-1, last])
    return w.reshape(x, w.op("Concat", [w.ints([-1]), w.op("Slice", [w.op("Shape", [x]), w.ints([-1]),
                                                                        w.ints([2 ** 62])])], axis=0))


def _as_matrices(c: GradientContext, a: str, b: str, dy: str, ra: int, rb: int) -> tuple[str, str, str]:
    """The operands and dY with the axes numpy's matmul gives 1-D operands (typed, for sum_to)."""
    w = c.writer
    if ra == 1:
        a2 = w.unsqueeze(a, [0])
        c.types[a2] = TensorType(c.type_of(a).elem_type, (1, *c.type_of(a).shape))
        dy = w.unsqueeze(dy, [-1 if rb == 1 else -2])
    else:
        a2 = a
    if rb == 1:
        b2 = w.unsqueeze(b, [1])
        c.types[b2] = TensorType(c.type_of(b).elem_type, (*c.type_of(b).shape, 1))
        dy = w.unsqueeze(dy, [-1])
    else:
        b2 = b
    return a2, b2, dy


def _back_to(c: GradientContext, value: str, operand: str, rank: int) -> str:
    """A promoted 1-D operand's gradient reshaped back to its one axis."""
    return value if rank > 1 else c.writer.reshape(value, c.shape_of(operand))


@gradient("Gemm", inputs=(0, 1, 2))
def gemm(c: GradientContext) -> dict[int, str]:
    """Y = alpha A' B' + beta C, A' = A or its transpose (transA), B' likewise."""
    w, dy, y = c.writer, c.dy(), c.output(0)
    a, b, bias = c.input(0), c.input(1), c.input(2)
    alpha, beta = c.attr("alpha", 1.0), c.attr("beta", 1.0)
    ta, tb = c.attr("transA", 0), c.attr("transB", 0)
    result = {}
    if c.wants(0):
        # dA' = alpha dY B'^T; dA = dA' or its transpose
        if not ta:
            result[0] = w.op("Gemm", [dy, b], alpha=alpha, transB=0 if tb else 1)
        else:
            result[0] = w.op("Gemm", [b, dy], alpha=alpha, transA=tb, transB=1)
    if c.wants(1):
        # dB' = alpha A'^T dY; dB = dB' or its transpose
        if not tb:
            result[1] = w.op("Gemm", [a, dy], alpha=alpha, transA=0 if ta else 1)
        else:
            result[1] = w.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=ta)
    if c.wants(2) and bias is not None:
        scaled = dy if beta == 1.0 else w.op("Mul", [dy, c.scalar_like(beta, y)])
        result[2] = sum_to(c, scaled, bias, y)
    return result


_TERM = re.compile(r"\.\.\.|[A-Za-z]")


@gradient("Einsum", inputs=None)
def einsum(c: GradientContext) -> dict[int, str]:
    """Operand i's gradient is the Einsum of dY with the other operands onto operand i's subscripts; indices only
    operand i has (summed away in the forward) come back by broadcasting."""
    w = c.writer
    equation = c.attr("equation").replace(" ", "")
    inputs_part, _, output_part = equation.partition("->")
    terms = [_TERM.findall(term) for term in inputs_part.split(",")]
    if not _:
        seen = [t for term in terms for t in term]
        output = sorted({t for t in seen if seen.count(t) == 1 and t != "..."})
        output_terms = (["..."] if any("..." in term for term in terms) else []) + output
    else:
        output_terms = _TERM.findall(output_part)
    result = {}
    for i in c.wanted:
        mine = terms[i]
        if len(set(mine)) != len(mine):
            raise c.refuse(f"repeated subscripts in {''.join(mine)!r} (a diagonal) are not supported")
        others = [t for k, term in enumerate(terms) if k != i for t in term]
        reachable = [t for t in mine if t in output_terms or t in others]
        sources = [output_terms, *(terms[k] for k in range(len(terms)) if k != i)]
        names = [c.dy(), *(c.input(k) for k in range(len(terms)) if k != i)]
        spec = ",".join("".join(s) for s in sources) + "->" + "".join(reachable)
        value = w.op("Einsum", names, equation=spec)
        if len(reachable) != len(mine):
            missing = [axis for axis, t in enumerate(mine) if t not in reachable]
            value = w.op("Expand", [w.unsqueeze(value, missing), w.op("Shape", [c.input(i)])])
        result[i] = value
    return result
