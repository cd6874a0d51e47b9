"""transformer-mini: two pre-LN transformer layers classifying sequences of 16 tokens.

Blocks, in order:

- ``embed``: token embedding (Gather, vocab 32 x d 32) + learned positional embedding
- ``attn1``: LayerNorm, 2-head self-attention (Q/K/V MatMul+Add, Reshape [0, T, H, d_head],
  Transpose, MatMul, scale, Softmax, MatMul, output projection), residual Add
- ``mlp1``: LayerNorm, MatMul 32->64, GELU (``0.5*x*(1+Erf(x/sqrt(2)))``), MatMul 64->32,
  residual Add
- ``attn2``, ``mlp2``: the second layer, same shapes
- ``head``: final LayerNorm, mean over the 16 positions (ReduceMean), Gemm 32->classes

Each residual Add sits in the block that computes its branch, so every cut (between
layers or between a layer's attention and MLP halves) is crossed by one tensor, [N, 16, 32].
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from edgert.models.graph import GraphBuilder
from edgert.models.layers import gelu, layer_norm, linear, projection

if TYPE_CHECKING:
    import onnx

    from edgert.models import ModelSpec

D_MODEL = 32
HEADS = 2
D_FF = 64
LAYERS = 2


def build(spec: ModelSpec, seed: int) -> onnx.ModelProto:
    """The transformer-mini model for ``spec`` (tokens [N, T] int64, logits [N, classes])."""
    b = GraphBuilder(spec.name, seed)
    tokens = b.input(spec.input_name, spec.input_dtype, ["N", *spec.input_shape])
    seq_len = spec.input_shape[0]
    with b.block("embed"):
        table = b.normal("tok", "weight", (spec.vocab_size, D_MODEL), 1 / math.sqrt(D_MODEL))
        positions = b.normal("pos", "weight", (seq_len, D_MODEL), 1 / math.sqrt(D_MODEL))
        x = b.op("Add", [b.op("Gather", [table, tokens], "tok", axis=0), positions], "pos")
    for layer in range(1, LAYERS + 1):
        with b.block(f"attn{layer}"):
            x = b.op(
                "Add", [x, _attention(b, layer_norm(b, x, "ln", D_MODEL), seq_len)], "residual"
            )
        with b.block(f"mlp{layer}"):
            h = layer_norm(b, x, "ln", D_MODEL)
            h = projection(b, h, "fc1", D_MODEL, D_FF, relu_follows=True)  # GELU is ReLU-like
            h = projection(b, gelu(b, h, "gelu"), "fc2", D_FF, D_MODEL, relu_follows=False)
            x = b.op("Add", [x, h], "residual")
    with b.block("head"):
        x = b.op("ReduceMean", [layer_norm(b, x, "ln", D_MODEL)], "pool", axes=[1], keepdims=0)
        logits = linear(
            b, x, "linear", D_MODEL, spec.num_classes, relu_follows=False, output=spec.output_name
        )
    return b.model(logits, "float32", ["N", spec.num_classes], spec.metadata(seed))


def _attention(b: GraphBuilder, x: str, seq_len: int) -> str:
    """Multi-head self-attention on [N, T, d] -> [N, T, d], batch kept dynamic by Reshape 0."""
    d_head = D_MODEL // HEADS
    split = b.constant("heads", "shape", np.array([0, seq_len, HEADS, d_head], np.int64))
    merge = b.constant("context", "shape", np.array([0, seq_len, D_MODEL], np.int64))
    scale = b.constant("scores", "scale", np.array(1 / math.sqrt(d_head), np.float32))

    def heads(sub: str, perm: list[int]) -> str:
        h = projection(b, x, sub, D_MODEL, D_MODEL, relu_follows=False)
        h = b.op("Reshape", [h, split], sub)
        return b.op("Transpose", [h], sub, perm=perm)

    q = heads("q", [0, 2, 1, 3])  # [N, H, T, d_head]
    k = heads("k", [0, 2, 3, 1])  # [N, H, d_head, T]
    v = heads("v", [0, 2, 1, 3])
    scores = b.op("Mul", [b.op("MatMul", [q, k], "scores"), scale], "scores")
    context = b.op("MatMul", [b.op("Softmax", [scores], "scores", axis=-1), v], "context")
    context = b.op("Transpose", [context], "context", perm=[0, 2, 1, 3])
    context = b.op("Reshape", [context, merge], "context")
    return projection(b, context, "out", D_MODEL, D_MODEL, relu_follows=False)
