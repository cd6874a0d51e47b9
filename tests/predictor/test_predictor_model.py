"""The latency predictor on synthetic profiles: fitting, online learning, storage, bad input."""

import json

import numpy as np
import pytest

from edgert.exporter.errors import PredictorError
from edgert.exporter.predictor.features import CATEGORIES, COLUMNS
from edgert.exporter.predictor.latency import (
    Features,
    LatencyPredictor,
    Observation,
    design_row,
    load_predictor,
    mape,
    nnls,
    save_predictor,
)

MICRO_BATCHES = (2, 8, 32)


def random_features(rng: np.random.Generator, count: int) -> list[Features]:
    """Stages with a random mix of op categories, sized like the zoo's blocks."""
    features = []
    for _ in range(count):
        present = rng.random(len(CATEGORIES)) < 0.5
        flops = dict(zip(CATEGORIES, present * rng.uniform(1e3, 5e5, len(CATEGORIES))))
        features.append(Features(nodes=int(rng.integers(1, 30)), tensors=int(rng.integers(0, 12)),
                                 param_bytes=int(rng.integers(0, 400_000)),
                                 conv_weights=float(rng.uniform(0, 4e4)), conv_padding=float(rng.uniform(0, 1e5)),
                                 im2col=float(rng.uniform(0, 1e5)),
                                 gemm_calls=float(rng.integers(0, 64)), activation_bytes=int(rng.integers(1e3, 4e5)),
                                 grad_in_bytes=int(rng.integers(0, 5e4)), out_bytes=int(rng.integers(40, 5e4)),
                                 **flops))
    return features


def true_rates(rng: np.random.Generator) -> np.ndarray:
    """Forward and backward ms per unit of each column, the backward about 2-3x the forward."""
    forward = rng.uniform(0.005, 0.1, len(COLUMNS))
    return np.stack([forward, forward * rng.uniform(1.5, 3.5, len(COLUMNS))])


def observations(device: str, rates: np.ndarray, features: list[Features], noise: float = 0.0,
                 seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    result = []
    for index, f in enumerate(features):
        for micro_batch in MICRO_BATCHES:
            forward, backward = rates @ design_row(f, micro_batch) * (rng.lognormal(0, noise, 2) if noise else 1.0)
            result.append(Observation(device, f, micro_batch, float(forward), float(backward), stage=f"s{index}"))
    return result


def errors(predictor: LatencyPredictor, device: str, tests: list[Observation]) -> float:
    predicted = [predictor.predict(device, o.features, o.micro_batch) for o in tests]
    return mape(predicted, [o.times() for o in tests])


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(7)
    rates = true_rates(rng)
    train, test = random_features(rng, 60), random_features(rng, 30)
    # two profiled devices: the population mix at speed 1, and a 2.5x slower one with its own mix
    slow = rates * 2.5 * np.exp(rng.normal(0, 0.2, rates.shape))
    profiles = observations("a", rates, train) + observations("b", slow, train)
    return rates, slow, train, test, profiles


def test_nnls_matches_scipy_and_is_non_negative():
    from scipy.optimize import nnls as scipy_nnls

    rng = np.random.default_rng(1)
    for _ in range(20):
        a, b = rng.normal(size=(40, 12)), rng.normal(size=40)
        ours, reference = nnls(a, b), scipy_nnls(a, b)[0]
        assert (ours >= 0).all()
        assert np.linalg.norm(a @ ours - b) <= np.linalg.norm(a @ reference - b) * (1 + 1e-9) + 1e-9


def test_fit_recovers_known_rates(world):
    rates, slow, train, test, profiles = world
    predictor = LatencyPredictor().fit(profiles)
    assert errors(predictor, "a", observations("a", rates, test)) < 0.01
    assert errors(predictor, "b", observations("b", slow, test)) < 0.01
    fitted = LatencyPredictor().fit(observations("a", rates, train)).rates("a")
    for k, direction in enumerate(("forward", "backward")):
        recovered = np.array([fitted[direction][c] for c in COLUMNS])
        assert np.allclose(recovered, rates[k], rtol=0.02)


def test_fit_with_noise_stays_close(world):
    rates, slow, train, test, _ = world
    predictor = LatencyPredictor().fit(observations("a", rates, train, noise=0.1, seed=1) +
                                       observations("b", slow, train, noise=0.1, seed=2))
    assert errors(predictor, "a", observations("a", rates, test)) < 0.08


def test_predictions_are_non_negative(world):
    *_, profiles = world
    predictor = LatencyPredictor().fit(profiles)
    predictor.add_device("new", scale=0.5)
    for f in [Features(), *random_features(np.random.default_rng(3), 50)]:
        for device in ("a", "b", "new"):
            forward, backward = predictor.predict(device, f, 1)
            assert forward >= 0 and backward >= 0


def test_online_learning_makes_an_unseen_device_accurate(world):
    rates, _, train, test, profiles = world
    predictor = LatencyPredictor().fit(profiles)
    # an unseen device: 6x slower than the population, matmul and elementwise relatively slower still
    mix = np.ones(len(COLUMNS))
    mix[[COLUMNS.index("matmul"), COLUMNS.index("elementwise")]] = 2.0
    unseen = rates * 6.0 * mix
    stream = observations("new", unseen, train, seed=5)
    order = np.random.default_rng(0).permutation(len(stream))
    tests = observations("new", unseen, test)
    predictor.add_device("new")
    measured = {0: errors(predictor, "new", tests)}
    for step, index in enumerate(order[:10], start=1):
        o = stream[index]
        predictor.observe("new", o.features, o.micro_batch, o.forward_ms, o.backward_ms)
        if step in (1, 3, 10):
            measured[step] = errors(predictor, "new", tests)
    assert measured[0] > 0.6  # the population knows nothing of the device's speed
    assert measured[1] < 0.25  # one stage time fixes the speed
    assert measured[3] < 0.2
    assert measured[10] < 0.12  # a few more learn the mix
    assert predictor.devices["new"].observations == 10


def test_online_learning_follows_a_device_that_slows_down(world):
    rates, _, train, test, profiles = world
    predictor = LatencyPredictor().fit(profiles)
    stream = observations("a", rates * 8, train, seed=6)  # the device became 8x slower
    tests = observations("a", rates * 8, test)
    assert errors(predictor, "a", tests) > 0.8
    for o in stream[:3]:
        predictor.observe("a", o.features, o.micro_batch, o.forward_ms, o.backward_ms)
    assert errors(predictor, "a", tests) < 0.15


def test_calibrate_scales_the_population(world):
    rates, _, train, test, profiles = world
    predictor = LatencyPredictor().fit(profiles)
    first = observations("c", rates * 3, train[:1])[0]
    scale = predictor.calibrate("c", first.features, first.micro_batch, first.forward_ms, first.backward_ms)
    assert 1.5 < scale < 2.5  # the population sits between devices a and b = 2.5 a: 3 / sqrt(2.5) = 1.9
    assert errors(predictor, "c", observations("c", rates * 3, test)) < 0.3


def test_json_round_trip_keeps_predictions_and_learning(world, tmp_path):
    rates, _, train, test, profiles = world
    predictor = LatencyPredictor().fit(profiles)
    predictor.observe("new", test[0], 8, 1.0, 2.5)
    copy = load_predictor(save_predictor(predictor, tmp_path / "predictor.json"))
    assert copy.to_json() == json.loads(json.dumps(predictor.to_json()))
    for f in test[:10]:
        assert copy.predict("new", f, 8) == pytest.approx(predictor.predict("new", f, 8), rel=1e-12)
        assert copy.predict("a", f, 2) == pytest.approx(predictor.predict("a", f, 2), rel=1e-12)
    for p in (predictor, copy):
        p.observe("new", test[1], 4, 0.7, 1.9)
    assert copy.predict("new", test[2], 32) == pytest.approx(predictor.predict("new", test[2], 32), rel=1e-12)


def test_bad_input_is_reported_with_the_value(world):
    *_, profiles = world
    predictor = LatencyPredictor().fit(profiles)
    with pytest.raises(PredictorError, match="unknown device 'zz'.*a, b"):
        predictor.predict("zz", Features(), 4)
    with pytest.raises(PredictorError, match="micro-batch must be >= 1 .got 0"):
        predictor.predict("a", Features(), 0)
    with pytest.raises(PredictorError, match="forward_ms must be a positive time .got -1"):
        predictor.observe("a", Features(nodes=1), 4, -1.0, 1.0)
    with pytest.raises(PredictorError, match="no observations"):
        LatencyPredictor().fit([])
    with pytest.raises(PredictorError, match="not fitted"):
        LatencyPredictor().add_device("x")
    with pytest.raises(PredictorError, match="not an edgert predictor"):
        LatencyPredictor.from_json({"format": "other"})
    with pytest.raises(PredictorError, match="unknown field"):
        Features.from_json({"nodes": 1, "tensor_cores": 3})
    with pytest.raises(PredictorError, match="positive measured"):
        mape([1.0], [0.0])


def test_mape():
    assert mape([1.1, 0.8], [1.0, 1.0]) == pytest.approx(0.15)


def test_predicting_and_learning_need_no_onnx():
    """The coordinator refines the predictor online; like the runtime, it must not need onnx."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['onnx'] = None\n"
            "from edgert.exporter.predictor.latency import Features, LatencyPredictor, load_predictor\n")
    subprocess.run([sys.executable, "-c", code], check=True)
