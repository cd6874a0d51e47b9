"""edgert.inference: use a trained model, on any machine with stock onnxruntime (a board too).

Map of the package:

- ``model.py``     :class:`TrainedModel`: a one-input ONNX model in an onnxruntime session, its input, the
                   metadata ``edgert merge`` recorded (loss, the run's data settings, class names)
- ``evaluate.py``  ``edgert evaluate``: loss and accuracy on a data set, split and prepared as the run did
- ``predict.py``   ``edgert predict``: top classes for samples in .npy/.npz files or image files
- ``errors.py``    :class:`InferenceError`

It imports the contract (scoring, onnxruntime, providers) and the data formats (edgert.models),
never onnx, torch, scikit-learn, the exporter or a role (tests/test_architecture.py).
"""
