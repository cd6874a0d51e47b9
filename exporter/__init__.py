"""edgert.exporter: the host side, from one ONNX model to a plan of training stages stock onnxruntime runs.

Map of the package (docs/EXPORTER.md; the plan format is docs/MANIFEST.md):

- ``source.py``          :func:`load_source_model`: read (external data too), validate, lower the IR version
- ``normalise.py``       :func:`normalise` -> :class:`TrainableGraph`: the training form of the graph
- ``recurrent.py``       :func:`unroll_recurrent`: RNN/GRU/LSTM unrolled into standard operators
- ``analyse.py``         :func:`analyse` -> :class:`ModelAnalysis`: blocks, FLOPs, crossing tensors
- ``flops.py``           per-node forward FLOPs
- ``cuts.py``            explicit cuts, or FLOP-balanced cuts
- ``slice.py``           :func:`slice_stage` -> :class:`StageGraph`: one stage's forward sub-graph
- ``loss.py``            the real loss (last stage), the gradient inputs (the others)
- ``gradients/``         edgert's own gradient builder: one rule per forward operator, standard operators only
  (its ``__init__.py`` lists its modules)
- ``artifacts.py``       :func:`build_stage_artifacts` -> :class:`StageArtifacts`: a stage's graphs and state
- ``standard_ops.py``    :func:`refuse_nonstandard`: what stock onnxruntime runs
- ``graph_writer.py``    :class:`GraphWriter`: unique names, typed constants, opset-aware reductions
- ``graph_walk.py``      :func:`reads`, :func:`needed_nodes`, :func:`drop_unneeded`: a graph walked back from the
  tensors wanted
- ``stash.py``           the training graph split for activation stashing (no recomputation)
- ``weight_split.py``    :func:`split_backward`: a backward split into input and parameter gradients (B/W)
- ``export.py``          :func:`export_plan`: ``edgert export``, the whole pipeline, writes the plan folder
- ``check.py``           :func:`check_plan`: ``edgert check``, the formulas and the chained stages against float64
- ``float64.py``         :class:`Float64Evaluator`: a graph run in float64 (onnx's reference evaluator, edgert's
  convolution kernels)
- ``float64_model.py``   :class:`Float64Model`: an unsplit plan trained in float64, check's reference
- ``check_training_build.py`` ``edgert check --reference training-build``: each stage against the training build's
- ``training_build.py``  :func:`reference_plan`: a plan's stages differentiated by the ONNX Runtime training build
  (an oracle: the ``reference`` extra)
- ``ort_training.py``    the one import of ONNX Runtime's training API (the oracle only, never torch)
- ``merge.py``           :func:`merge_run`: ``edgert merge``, a run's trained stages back into one ONNX model
- ``device_plan.py``     :func:`plan_for_devices`: ``edgert plan``, a plan cut for measured devices
- ``errors.py``          :class:`ExportError` and its kinds (:class:`PlanError`, :class:`PredictorError` ...)
- ``planner/``           :func:`plan`: cuts, device order, groups, codecs, threads; live re-planning
  (docs/PLANNER.md)
- ``predictor/``         :class:`LatencyPredictor`: stage times from op features, learnt online
  (docs/PREDICTOR.md)

Needs ``onnx`` (the ``host`` extra); a board never imports this package.
"""
