"""edgert.exporter.predictor: a stage's forward and backward time on a device, from its op features.

Map of the package (docs/PREDICTOR.md):

- ``latency.py``       :class:`LatencyPredictor` (fit offline, predict, learn a device online), :class:`Observation`,
  :func:`save_predictor`, :func:`load_predictor`, :func:`mape`, :func:`nnls`
- ``features.py``      :class:`Features` of blocks and stages: FLOPs by op category, bytes, nodes;
  :func:`design_row`
- ``observations.py``  measured stage times as observations: through the real stage runtime, or from
  ``devices.json``

The models it is fitted on besides the zoo are in models/fitting_set.py; ``PredictorError`` is in
exporter/errors.py.
"""
