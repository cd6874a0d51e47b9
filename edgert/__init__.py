"""edgert: pipeline-parallel training of one ONNX model across several edge devices.

Map of the package (the folder layout is the architecture):

- ``edgert/``             the on-device runtime and the coordinator role; needs no ``onnx``
  - ``errors.py``         :class:`EdgertError` and friends: one line a user can act on
  - ``ort_import.py``     the one way onnxruntime is imported: stock or training build, never torch, never both
  - ``ort_training.py``   torch-free import of ONNX Runtime's training API (host only)
  - ``providers.py``      the execution providers a worker's sessions use (``--providers``)
  - ``readiness.py``      ``edgert doctor``: is this board ready to be a worker
  - ``manifest.py``       :class:`Manifest`: the on-disk plan format (docs/MANIFEST.md)
  - ``stage.py``          :class:`StageSession`: one stage's forward/backward/step on stock onnxruntime
  - ``optimizer.py``      AdamW / SGD with optimizer state readable and writable by name
  - ``schedule.py``       gpipe / 1f1b / async action lists, and ``simulate``
  - ``executor.py``       :class:`StageExecutor`: walks a stage's schedule on the compute thread
  - ``inbox.py``          tensors from the network, waited for by the compute thread
  - ``worker*.py``        ``edgert worker``: resources, compute thread, state, measurement, sends in flight
                          (``worker_sends.py``); what its inbox takes (``worker_inputs.py``: which peer, step, shapes)
  - ``protocol.py``       the runtime's messages (docs/PROTOCOL.md, section 9), read by ``meta_fields.py``
  - ``coordinator*.py``   ``edgert train``: run, re-plan, recover; what its resources take
                          (``coordinator_inputs.py``: which run, stage, sender, step); ``ledger.py`` the step reports
  - ``assignment.py``     stages onto workers, state migration between workers
  - ``replica.py``, ``recovery.py``  copies for recovery; failure detection, snapshots
  - ``weights.py``        :class:`StageState`: a stage's state as one message / file
  - ``checkpoint.py``     :class:`CheckpointInfo`: a checkpoint folder's ``checkpoint.json``
  - ``devices.py``, ``profiler.py``  devices.json; measuring a stage on this device
  - ``typed_json.py``     strict JSON -> dataclass loading behind devices.json and checkpoint.json
  - ``runlog.py``        the run folder: one run each, metrics.jsonl, and the rule for reading it back
  - ``tracefile.py``, ``run_summary.py``  trace.json streamed to disk; the whole run's summary, from disk
  - ``data.py``, ``evaluation.py``, ``progress.py``, ``localcluster.py``
  - ``fault_injection.py``, ``recovery_bench.py``  SIGKILLs on cue; the recovery benchmark
  - ``cli/``              the ``edgert`` command line
- ``edgert.exporter``     host side: analyse, slice, build artifacts, check (needs ``onnx``)
- ``edgert.transport``    CoAP resources and client, CBOR tensors, compression codecs
- ``edgert.models``       the model zoo and the small offline datasets
"""

__version__ = "0.1.0"
