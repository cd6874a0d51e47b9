"""Gradient rules of elementwise operators: arithmetic with broadcasting, activations, casts, selections.

Formulas follow torch's ``derivatives.yaml`` where a choice exists (ties of Max/Min split the
gradient; HardSwish/HardSigmoid's edges), since torch autograd is the reference tests compare with.
"""

from __future__ import annotations

import math

from edgert.exporter.gradients.broadcast import sum_to
from edgert.exporter.gradients.registry import ALL_INPUTS, GradientContext, float_type, gradient

# -- arithmetic ---------------------------------------------------------------------------------


@gradient("Add", "Sub", inputs=(0, 1))
def add(c: GradientContext) -> dict[int, str]:
    dy, y, result = c.dy(), c.output(0), {}
    if c.wants(0):
        result[0] = sum_to(c, dy, c.input(0), y)
    if c.wants(1):
        negated = c.writer.op("Neg", [dy]) if c.node.op_type == "Sub" else dy
        result[1] = sum_to(c, negated, c.input(1), y)
    return result


@gradient("Mul", inputs=(0, 1))
def mul(c: GradientContext) -> dict[int, str]:
    w, dy, y = c.writer, c.dy(), c.output(0)
    a, b = c.input(0), c.input(1)
    result = {}
    if c.wants(0):
        result[0] = sum_to(c, w.op("Mul", [dy, b]), a, y)
    if c.wants(1):
        result[1] = sum_to(c, w.op("Mul", [dy, a]) if a != b else result[0], b, y)
    return result


@gradient("Div", inputs=(0, 1))
def div(c: GradientContext) -> dict[int, str]:
    """A / B: dA = dY / B, dB = -(dY / B) (A / B) = -dY Y / B."""
    w, dy, y = c.writer, c.dy(), c.output(0)
    scaled = w.op("Div", [dy, c.input(1)])
    result = {}
    if c.wants(0):
        result[0] = sum_to(c, scaled, c.input(0), y)
    if c.wants(1):
        result[1] = sum_to(c, w.op("Neg", [w.op("Mul", [scaled, y])]), c.input(1), y)
    return result


@gradient("Pow", inputs=(0, 1))
def power(c: GradientContext) -> dict[int, str]:
    """X^P: dX = dY P X^(P-1), dP = dY Y log(X)."""
    w, dy, y = c.writer, c.dy(), c.output(0)
    x, p = c.input(0), c.input(1)
    result = {}
    if c.wants(0):
        exponent = p if c.type_of(p).elem_type == c.type_of(x).elem_type else w.cast(p, c.type_of(x).elem_type)
        lowered = w.op("Pow", [x, w.op("Sub", [exponent, c.scalar_like(1.0, x)])])
        result[0] = sum_to(c, w.op("Mul", [dy, w.op("Mul", [exponent, lowered])]), x, y)
    if c.wants(1):
        result[1] = sum_to(c, w.op("Mul", [dy, w.op("Mul", [y, w.op("Log", [x])])]), p, y)
    return result


@gradient("Sum", "Mean", inputs=ALL_INPUTS)
def variadic_sum(c: GradientContext) -> dict[int, str]:
    dy, y = c.dy(), c.output(0)
    if c.node.op_type == "Mean":
        dy = c.writer.op("Div", [dy, c.scalar_like(float(len(c.node.input)), y)])
    return {i: sum_to(c, dy, c.input(i), y) for i in c.wanted}


@gradient("Max", "Min", inputs=ALL_INPUTS)
def extremum(c: GradientContext) -> dict[int, str]:
    """Each input equal to the result gets the gradient, shared evenly among ties (torch's maximum/minimum)."""
    w, dy, y = c.writer, c.dy(), c.output(0)
    elem = c.type_of(y).elem_type
    hits = {i: w.cast(w.op("Equal", [c.input(i), y]), elem) for i in range(len(c.node.input))}
    count = hits[0] if len(hits) == 1 else w.op("Sum", list(hits.values()))
    share = w.op("Div", [dy, count])
    return {i: sum_to(c, w.op("Mul", [share, hits[i]]), c.input(i), y) for i in c.wanted}


@gradient("Where", inputs=(1, 2))
def where(c: GradientContext) -> dict[int, str]:
    w, dy, y = c.writer, c.dy(), c.output(0)
    condition, zero = c.input(0), c.zero_like(y)
    result = {}
    if c.wants(1):
        result[1] = sum_to(c, w.op("Where", [condition, dy, zero]), c.input(1), y)
    if c.wants(2):
        result[2] = sum_to(c, w.op("Where", [condition, zero, dy]), c.input(2), y)
    return result


# -- unary --------------------------------------------------------------------------------------


@gradient("Identity")
def identity(c: GradientContext) -> dict[int, str]:
    return {0: c.dy()}


@gradient("Neg")
def neg(c: GradientContext) -> dict[int, str]:
    return {0: c.writer.op("Neg", [c.dy()])}


@gradient("Cast", "CastLike")
def cast(c: GradientContext) -> dict[int, str]:
    """Back to the input's element type; a cast to an integer type passes no gradient."""
    source, target = c.type_of(c.input(0)), c.type_of(c.output(0))
    if not float_type(target):
        return {}
    return {0: c.dy() if source.elem_type == target.elem_type else c.writer.cast(c.dy(), source.elem_type)}


def _scaled(c: GradientContext, slope: str) -> dict[int, str]:
    return {0: c.writer.op("Mul", [c.dy(), slope])}


@gradient("Relu")
def relu(c: GradientContext) -> dict[int, str]:
    y = c.output(0)
    return {0: c.writer.op("Where", [c.writer.op("Greater", [y, c.zero_like(y)]), c.dy(), c.zero_like(y)])}


@gradient("LeakyRelu")
def leaky_relu(c: GradientContext) -> dict[int, str]:
    w, dy, x = c.writer, c.dy(), c.input(0)
    scaled = w.op("Mul", [dy, c.scalar_like(c.attr("alpha", 0.01), x)])
    return {0: w.op("Where", [w.op("Greater", [x, c.zero_like(x)]), dy, scaled])}


@gradient("PRelu", inputs=(0, 1))
def prelu(c: GradientContext) -> dict[int, str]:
    w, dy, x, slope, y = c.writer, c.dy(), c.input(0), c.input(1), c.output(0)
    positive = w.op("Greater", [x, c.zero_like(x)])
    result = {}
    if c.wants(0):
        result[0] = w.op("Where", [positive, dy, w.op("Mul", [dy, slope])])
    if c.wants(1):
        result[1] = sum_to(c, w.op("Where", [positive, c.zero_like(x), w.op("Mul", [dy, x])]), slope, y)
    return result


@gradient("Elu", "Selu", "Celu")
def exponential_linear(c: GradientContext) -> dict[int, str]:
    """Above 0 the slope is 1 (Selu: gamma); below, the slope is the output plus alpha (Selu: times gamma;
    Celu: exp(x / alpha) = y / alpha + 1)."""
    w, x, y = c.writer, c.input(0), c.output(0)
    op = c.node.op_type
    alpha = c.attr("alpha", {"Elu": 1.0, "Selu": 1.67326319217681884765625, "Celu": 1.0}[op])
    gamma = c.attr("gamma", 1.05070102214813232421875) if op == "Selu" else 1.0
    if op == "Celu":
        below = w.op("Add", [w.op("Div", [y, c.scalar_like(alpha, y)]), c.scalar_like(1.0, y)])
    else:
        below = w.op("Add", [y, c.scalar_like(alpha * gamma, y)])
    slope = w.op("Where", [w.op("Greater", [x, c.zero_like(x)]), c.scalar_like(gamma, x), below])
    return _scaled(c, slope)


@gradient("Sigmoid")
def sigmoid(c: GradientContext) -> dict[int, str]:
    w, y = c.writer, c.output(0)
    return _scaled(c, w.op("Mul", [y, w.op("Sub", [c.scalar_like(1.0, y), y])]))


@gradient("Tanh")
def tanh(c: GradientContext) -> dict[int, str]:
    w, y = c.writer, c.output(0)
    return _scaled(c, w.op("Sub", [c.scalar_like(1.0, y), w.op("Mul", [y, y])]))


@gradient("Exp")
def exp(c: GradientContext) -> dict[int, str]:
    return _scaled(c, c.output(0))


@gradient("Log")
def log(c: GradientContext) -> dict[int, str]:
    return {0: c.writer.op("Div", [c.dy(), c.input(0)])}


@gradient("Sqrt")
def sqrt(c: GradientContext) -> dict[int, str]:
    w, y = c.writer, c.output(0)
    return {0: w.op("Div", [c.dy(), w.op("Mul", [y, c.scalar_like(2.0, y)])])}


@gradient("Reciprocal")
def reciprocal(c: GradientContext) -> dict[int, str]:
    w, y = c.writer, c.output(0)
    return {0: w.op("Neg", [w.op("Mul", [c.dy(), w.op("Mul", [y, y])])])}


@gradient("Abs")
def absolute(c: GradientContext) -> dict[int, str]:
    return _scaled(c, c.writer.op("Sign", [c.input(0)]))


@gradient("Sin")
def sine(c: GradientContext) -> dict[int, str]:
    return _scaled(c, c.writer.op("Cos", [c.input(0)]))


@gradient("Cos")
def cosine(c: GradientContext) -> dict[int, str]:
    w = c.writer
    return _scaled(c, w.op("Neg", [w.op("Sin", [c.input(0)])]))


@gradient("Erf")
def erf(c: GradientContext) -> dict[int, str]:
    w, x = c.writer, c.input(0)
    bump = w.op("Exp", [w.op("Neg", [w.op("Mul", [x, x])])])
    return _scaled(c, w.op("Mul", [bump, c.scalar_like(2 / math.sqrt(math.pi), x)]))


@gradient("Softplus")
def softplus(c: GradientContext) -> dict[int, str]:
    return _scaled(c, c.writer.op("Sigmoid", [c.input(0)]))


@gradient("Softsign")
def softsign(c: GradientContext) -> dict[int, str]:
    w, x = c.writer, c.input(0)
    denominator = w.op("Add", [c.scalar_like(1.0, x), w.op("Abs", [x])])
    return {0: w.op("Div", [c.dy(), w.op("Mul", [denominator, denominator])])}


@gradient("HardSigmoid")
def hard_sigmoid(c: GradientContext) -> dict[int, str]:
    """alpha inside the linear part (0 < alpha x + beta < 1, open as in torch), else 0."""
    w, x = c.writer, c.input(0)
    alpha, beta = c.attr("alpha", 0.2), c.attr("beta", 0.5)
    inner = w.op("Add", [w.op("Mul", [x, c.scalar_like(alpha, x)]), c.scalar_like(beta, x)])
    inside = w.op("And", [w.op("Greater", [inner, c.zero_like(x)]), w.op("Less", [inner, c.scalar_like(1.0, x)])])
    return {0: w.op("Where", [inside, w.op("Mul", [c.dy(), c.scalar_like(alpha, x)]), c.zero_like(x)])}


@gradient("HardSwish")
def hard_swish(c: GradientContext) -> dict[int, str]:
    """x relu6(x + 3) / 6: 0 below -3, x / 3 + 1/2 up to 3, 1 above (torch's hardswish_backward)."""
    w, x = c.writer, c.input(0)
    middle = w.op("Add", [w.op("Div", [x, c.scalar_like(3.0, x)]), c.scalar_like(0.5, x)])
    upper = w.op("Where", [w.op("LessOrEqual", [x, c.scalar_like(3.0, x)]), middle, c.scalar_like(1.0, x)])
    slope = w.op("Where", [w.op("Less", [x, c.scalar_like(-3.0, x)]), c.zero_like(x), upper])
    return _scaled(c, slope)


@gradient("Mish")
def mish(c: GradientContext) -> dict[int, str]:
    """x tanh(softplus(x)): tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)."""
    w, x = c.writer, c.input(0)
    t = w.op("Tanh", [w.op("Softplus", [x])])
    sech2 = w.op("Sub", [c.scalar_like(1.0, x), w.op("Mul", [t, t])])
    return _scaled(c, w.op("Add", [t, w.op("Mul", [w.op("Mul", [x, w.op("Sigmoid", [x])]), sech2])]))


def gelu_slope(c: GradientContext, x: str, approximate: str) -> str:
    """d gelu(x) / dx: Phi(x) + x phi(x) (exact, erf), or the tanh approximation's derivative."""
    w = c.writer
    if approximate == "none":
        cdf = w.op("Mul", [c.scalar_like(0.5, x), w.op("Add", [c.scalar_like(1.0, x), w.op(
            "Erf", [w.op("Mul", [x, c.scalar_like(1 / math.sqrt(2), x)])])])])
        pdf = w.op("Mul", [c.scalar_like(1 / math.sqrt(2 * math.pi), x), w.op(
            "Exp", [w.op("Mul", [w.op("Mul", [x, x]), c.scalar_like(-0.5, x)])])])
        return w.op("Add", [cdf, w.op("Mul", [x, pdf])])
    k, a = math.sqrt(2 / math.pi), 0.044715
    square = w.op("Mul", [x, x])
    inner = w.op("Mul", [c.scalar_like(k, x), w.op("Mul", [x, w.op("Add", [c.scalar_like(1.0, x), w.op(
        "Mul", [c.scalar_like(a, x), square])])])])
    t = w.op("Tanh", [inner])
    left = w.op("Mul", [c.scalar_like(0.5, x), w.op("Add", [c.scalar_like(1.0, x), t])])
    sech2 = w.op("Sub", [c.scalar_like(1.0, x), w.op("Mul", [t, t])])
    d_inner = w.op("Mul", [c.scalar_like(k, x), w.op("Add", [c.scalar_like(1.0, x), w.op(
        "Mul", [c.scalar_like(3 * a, x), square])])])
    right = w.op("Mul", [w.op("Mul", [c.scalar_like(0.5, x), x]), w.op("Mul", [sech2, d_inner])])
    return w.op("Add", [left, right])


@gradient("Gelu")
def gelu(c: GradientContext) -> dict[int, str]:
    return _scaled(c, gelu_slope(c, c.input(0), c.attr("approximate", "none")))


@gradient("Clip", inputs=(0,))
def clip(c: GradientContext) -> dict[int, str]:
    """The gradient where min <= x <= max (torch's clamp), else 0."""
    w, x = c.writer, c.input(0)
    inside = None
    for bound, compare in ((c.input(1), "GreaterOrEqual"), (c.input(2), "LessOrEqual")):
        if bound is None:
            continue
        if c.type_of(bound).elem_type != c.type_of(x).elem_type:
            bound = w.cast(bound, c.type_of(x).elem_type)
        test = w.op(compare, [x, bound])
        inside = test if inside is None else w.op("And", [inside, test])
    return {0: c.dy() if inside is None else w.op("Where", [inside, c.dy(), c.zero_like(x)])}

