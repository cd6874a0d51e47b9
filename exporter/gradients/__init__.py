"""edgert.exporter.gradients: edgert's own gradient builder, writing every backward in standard ONNX operators.

Map of the package (docs/EXPORTER.md, "Gradients"):

- ``builder.py``        :func:`build_gradient_graph`: the reverse-mode pass over a forward graph
- ``registry.py``       :data:`RULES`, :func:`gradient`, :func:`training_form`: one rule per forward operator,
  and :class:`GradientContext`, what a rule writes its part of the backward with
- ``rules.py``          imports every module below, which registers its rules (its docstring lists them)
- ``broadcast.py``      :func:`sum_to`: a broadcast operand's gradient summed back to its shape
- ``shapes.py``         :func:`forward_types`: every forward tensor's type and shape, from onnx's inference and
  a run of the graph where inference stops
- ``elementwise.py``, ``shaping.py``, ``linear.py``, ``reductions.py``, ``normalization.py``,
  ``convolution.py``, ``pooling.py``, ``losses.py``: the rules, by kind of operator
"""
