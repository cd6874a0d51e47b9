"""edgert: pipeline-parallel training of one ONNX model across several edge devices.

Map of the package (the folder layout is the architecture):

- ``edgert/``             the on-device runtime and the coordinator role; needs no ``onnx``
  - ``errors.py``         :class:`EdgertError` and friends: one line a user can act on
  - ``ort_training.py``   torch-free import of ONNX Runtime's training API
  - ``manifest.py``       :class:`Manifest`: the on-disk plan format (docs/MANIFEST.md)
  - ``stage.py``          :class:`StageSession`: one stage's forward/backward over ORT Training
  - ``optimizer.py``      AdamW / SGD with optimizer state readable and writable by name
  - ``cli/``              the ``edgert`` command line
- ``edgert.exporter``     host side: analyse, slice, build artifacts, check (needs ``onnx``)
- ``edgert.transport``    CoAP resources and client, CBOR tensors, compression codecs
- ``edgert.models``       the model zoo and the small offline datasets
"""

__version__ = "0.1.0"
