"""edgert.exporter: the host side, from one ONNX model to a plan of ORT training stages.

Map of the package (docs/EXPORTER.md; the plan format is docs/MANIFEST.md):

- ``source.py``          :func:`load_source_model`: read, validate, lower the IR version for ORT 1.19
- ``normalise.py``       :func:`normalise` -> :class:`TrainableGraph`: the training form of the graph
- ``recurrent.py``       :func:`unroll_recurrent`: RNN/GRU/LSTM unrolled into standard operators
- ``analyse.py``         :func:`analyse` -> :class:`ModelAnalysis`: blocks, FLOPs, crossing tensors
- ``flops.py``           per-node forward FLOPs
- ``cuts.py``            explicit cuts, or FLOP-balanced cuts
- ``slice.py``           :func:`slice_stage` -> :class:`StageGraph`: one stage's forward sub-graph
- ``loss.py``            the real loss (last stage) and the VJP loss (other stages)
- ``artifacts.py``       :func:`build_stage_artifacts` -> :class:`StageArtifacts`
- ``ort_training.py``    the one import of ONNX Runtime's training API (host only, never torch)
- ``portable.py``        :func:`make_portable`: gradient graphs stock onnxruntime runs (or a clear refusal)
- ``gradient_rules.py``  the standard-operator form of each training-build gradient operator
- ``convolution_rules.py`` the same for the convolution and pooling gradients
- ``graph_writer.py``    :class:`GraphWriter`: unique names, typed constants, opset-aware reductions
- ``graph_walk.py``      :func:`reads`, :func:`needed_nodes`: a graph walked back from the tensors wanted
- ``vjp_seed.py``        :func:`seed_from_gradients`: a non-last stage's backward started from its gradient inputs
- ``stash.py``           the training graph split for activation stashing (no recomputation)
- ``weight_split.py``    :func:`split_backward`: a backward split into input and parameter gradients (B/W)
- ``export.py``          :func:`export_plan`: ``edgert export``, the whole pipeline, writes the plan folder
- ``check.py``           :func:`check_plan`: ``edgert check``, chained stages against the unsplit model
- ``check_portable.py``  each stage's portable graphs against the training build's, both memory modes
- ``merge.py``           :func:`merge_run`: ``edgert merge``, a run's trained stages back into one ONNX model
- ``device_plan.py``     :func:`plan_for_devices`: ``edgert plan``, a plan cut for measured devices
- ``errors.py``          :class:`ExportError` and its kinds (:class:`PlanError`, :class:`PredictorError` ...)
- ``planner/``           :func:`plan`: cuts, device order, groups, codecs, threads; live re-planning
  (docs/PLANNER.md)
- ``predictor/``         :class:`LatencyPredictor`: stage times from op features, learnt online
  (docs/PREDICTOR.md)

Needs ``onnx`` (the ``host`` extra); a board never imports this package.
"""
