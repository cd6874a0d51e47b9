"""Every gradient rule, registered in ``registry.RULES`` by importing the modules that define them.

- ``elementwise.py``    Add, Sub, Mul, Div, Pow, Sum, Mean, Max, Min, Where, Identity, Neg, Cast, the activations
  (Relu, LeakyRelu, PRelu, Elu, Selu, Celu, Sigmoid, Tanh, HardSigmoid, HardSwish, Gelu, Mish, Softplus,
  Softsign, Erf, Exp, Log, Sqrt, Reciprocal, Abs, Sin, Cos), Clip
- ``shaping.py``        Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Expand, Concat, Split, Slice, Gather,
  GatherElements, GatherND, ScatterND, ScatterElements, Pad, Tile, Trilu, CumSum
- ``linear.py``         MatMul, Gemm, Einsum
- ``reductions.py``     ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceSumSquare, ReduceL2, ReduceLogSumExp,
  GlobalAveragePool, GlobalMaxPool, Softmax, LogSoftmax
- ``normalization.py``  BatchNormalization, LayerNormalization, InstanceNormalization
- ``convolution.py``    Conv, ConvTranspose
- ``pooling.py``        MaxPool, AveragePool
- ``losses.py``         SoftmaxCrossEntropyLoss
"""

from edgert.exporter.gradients import (  # noqa: F401  (each registers its rules)
    convolution,
    elementwise,
    linear,
    losses,
    normalization,
    pooling,
    reductions,
    shaping,
)
