"""edgert: pipeline-parallel training of one ONNX model across several edge devices.

Map of the package (the folder layout is the architecture; tests/test_architecture.py keeps its import rules):

- ``edgert/`` top level: the contract the worker and the coordinator both speak; imports neither role
  - ``errors.py``         :class:`EdgertError` and the errors both sides raise: one line a user can act on
  - ``protocol/``         the runtime's messages and resources, one module per family (docs/PROTOCOL.md)
  - ``run_settings.py``   :class:`RunSettings`: what every stage of a run is told, each default stated once
  - ``manifest.py``       :class:`Manifest`: the on-disk plan format (docs/MANIFEST.md)
  - ``schedule.py``       the schedule vocabulary: gpipe / 1f1b / async, typed actions (``2F0``), micro-batches, windows
  - ``stage.py``          :class:`StageSession`: one stage's forward/backward/step on stock onnxruntime
  - ``chain.py``          all stages of a plan chained in one process: the reference a run must match
  - ``optimizer.py``      AdamW / SGD with optimizer state readable and writable by name
  - ``weights.py``        :class:`StageState`: a stage's state as one envelope / file, its bound, moved in pieces
  - ``replica.py``        copies of stage states kept for recovery, with their byte budgets
  - ``checkpoint.py``     :class:`CheckpointInfo`: a checkpoint folder's ``checkpoint.json``
  - ``devices.py``        ``devices.json``: what each device measured (docs/DEVICES.md)
  - ``typed_data.py``     nested dataclasses <-> plain maps, read strictly: manifest, devices.json, checkpoint.json,
                          every runtime message's ``meta`` on the wire (one rule per field, in its metadata)
  - ``ort_import.py``     the one way onnxruntime is imported: stock or training build, never torch
  - ``providers.py``      the execution providers a worker's sessions use (``--providers``)
  - ``progress.py``       the one-line progress display of long work (a run, reading data, an evaluation)
  - ``scoring.py``        loss and accuracy of predictions, summed batch by batch (evaluations on both sides)
- ``edgert.worker``       ``edgert worker``: what runs on a board (never loads exporter, coordinator, bench, onnx)
- ``edgert.coordinator``  ``edgert train`` / ``edgert profile``: the central node
- ``edgert.security``     the cluster's certificate authority, stage signatures and admission, graph scans
- ``edgert.bench``        ``edgert bench``: benchmarks and the fault injection they share with the tests
- ``edgert.cli``          the ``edgert`` command line (``__main__.py``: ``python -m edgert``, the same)
- ``edgert.exporter``     host side: analyse, slice, build artifacts, check, plan (needs ``onnx``)
- ``edgert.transport``    the wire: CoAP resources and client, CBOR tensors, compression codecs, TLS, OSCORE
- ``edgert.models``       the model zoo and the small offline datasets
"""

__version__ = "0.1.0"
