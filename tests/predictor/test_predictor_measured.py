"""The predictor on real stage times measured on this host (small and quick, so a loose bound)."""

import numpy as np
import pytest

from edgert.devices import BlockTiming, DeviceProfile, DevicesFile
from edgert.exporter.errors import PredictorError
from edgert.exporter.predictor.latency import LatencyPredictor, mape
from edgert.exporter.predictor.observations import DeviceSetup, observations_from_devices, profile_models
from edgert.models import build_model, list_models
from edgert.models.fitting_set import EXTRA_MODELS

# The full evaluation (tools/eval_predictor.py: 4 devices, 3 micro-batches, 6 passes) measures
# about 11-12% on this 2-core host; one device and four passes get 10-15% when idle. Two passes
# measured 26% once on a busy CI host (each observation keeps its fastest pass, so more passes
# ride out a burst of load).
HELDOUT_MODEL_BOUND = 0.25


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    builders = {spec.name: (lambda n=spec.name: build_model(n)) for spec in list_models()}
    builders.update(EXTRA_MODELS)
    return profile_models(builders, tmp_path_factory.mktemp("profiles"), devices=[DeviceSetup("t11")],
                          micro_batches=(2, 16), rounds=4)


def test_leave_one_model_out_error_on_measured_blocks(measured):
    errors = {}
    for spec in list_models():
        predictor = LatencyPredictor().fit([o for o in measured if o.model != spec.name])
        tests = [o for o in measured if o.model == spec.name]
        predicted = [predictor.predict(o.device, o.features, o.micro_batch) for o in tests]
        errors[spec.name] = mape(predicted, [o.times() for o in tests])
    assert np.mean(list(errors.values())) <= HELDOUT_MODEL_BOUND, errors


def test_devices_file_becomes_observations(measured):
    from edgert.exporter.export import ExportOptions, prepare_analysis
    from edgert.exporter.source import from_model_proto

    analysis = prepare_analysis(from_model_proto(build_model("cnn"), "cnn.onnx"), ExportOptions())
    timings = (BlockTiming("conv1", 0.2, 0.5), BlockTiming("conv2+conv3", 1.0, 3.0), BlockTiming("fc", 0.0, 0.0))
    devices = DevicesFile(model_sha256="x", blocks=tuple(b.name for b in analysis.blocks), micro_batch=16,
                          devices=(DeviceProfile("board", blocks=timings),))
    observations = observations_from_devices(devices, analysis, model="cnn")
    assert [(o.stage, o.micro_batch, o.forward_ms) for o in observations] == [("conv1", 16, 0.2),
                                                                             ("conv2+conv3", 16, 1.0)]
    assert observations[1].features.conv > observations[0].features.conv
    predictor = LatencyPredictor().fit(measured)
    for o in observations:
        predictor.observe("board", o.features, o.micro_batch, o.forward_ms, o.backward_ms)
    assert predictor.predict("board", observations[0].features, 16)[0] > 0
    bad = DevicesFile(model_sha256="x", blocks=(), micro_batch=16,
                      devices=(DeviceProfile("board", blocks=(BlockTiming("conv1+fc", 1.0, 2.0),)),))
    with pytest.raises(PredictorError, match="'conv1\\+fc' is not a run of adjacent blocks"):
        observations_from_devices(bad, analysis)
