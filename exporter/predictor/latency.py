"""Latency predictor: a stage's forward and backward time on a device, from its op features.

The model (docs/PREDICTOR.md) is linear and non-negative in the columns of
:func:`design_row`: a per-call cost, a per-node cost, a per-parameter-byte cost, and per
op category a cost per MFLOP, plus costs per MB of activations and boundary, all times the
micro-batch. A device is its own rates: ``rates = base * exp(a + b)``, where ``base`` is
fitted offline from profiles (population rates for an unseen device, scaled by a
calibration factor) and ``(a, b)`` (a log speed and log per-column corrections) is learnt
online by an extended Kalman filter on measured stage times.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgert.exporter.errors import PredictorError
from edgert.exporter.predictor.features import (
    COLUMNS,
    Features,
    block_features,
    design_row,
    feature_matrix,
    join_features,
    stage_features,
)

__all__ = [
    "Features", "LatencyPredictor", "Observation", "OnlineSettings", "block_features",
    "design_row", "join_features", "load_predictor", "mape", "nnls", "save_predictor", "stage_features",
]

FORMAT = "edgert-predictor"
FORMAT_VERSION = 1
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Observation:
    """One measured stage on one device: its features, micro-batch, and forward and backward ms."""

    device: str
    features: Features
    micro_batch: int
    forward_ms: float
    backward_ms: float
    model: str = ""
    stage: str = ""  # block names joined by "+"
    spread: float = 0.0  # the measurement's own relative noise, when known

    def times(self) -> tuple[float, float]:
        return self.forward_ms, self.backward_ms

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "features": self.features.to_json(), "micro_batch": self.micro_batch,
                "forward_ms": self.forward_ms, "backward_ms": self.backward_ms, "model": self.model,
                "stage": self.stage, "spread": self.spread}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Observation:
        return cls(**{**data, "features": Features.from_json(data["features"])})


@dataclass(frozen=True)
class OnlineSettings:
    """Priors and noise of the online filter, in natural-log units."""

    unseen_speed_sd: float = 1.0  # an unseen device's speed vs the population: e^1 = 2.7x per sd
    unseen_mix_sd: float = 0.3  # its per-column deviation from the population's mix
    fitted_speed_sd: float = 0.2  # a profiled device may have drifted since its profile
    fitted_mix_sd: float = 0.1
    measurement_sd: float = 0.15  # one stage time's noise (2-core hosts are noisy)
    speed_drift_sd: float = 0.03  # per observation: devices change speed while training
    mix_drift_sd: float = 0.01
    surprise_sd: float = 4.0  # an innovation this many sd out re-opens the speed prior


@dataclass
class _DeviceState:
    """A device's base rates and its online log corrections, per direction."""

    base: np.ndarray  # (2, C): ms per unit of each column, forward and backward
    mean: np.ndarray  # (2, 1 + C): log speed a, then log per-column corrections b
    cov: np.ndarray  # (2, 1 + C, 1 + C)
    fitted: bool
    observations: int = 0

    def rates(self) -> np.ndarray:
        return self.base * np.exp(self.mean[:, :1] + self.mean[:, 1:])


class LatencyPredictor:
    """Predicts forward/backward ms of a stage on a device; fitted on profiles, refined online."""

    def __init__(self, population: np.ndarray | None = None, settings: OnlineSettings | None = None,
                 ridge: float = 0.3):
        self.population = np.zeros((2, len(COLUMNS))) if population is None else np.asarray(population, float)
        self.settings = settings or OnlineSettings()
        self.ridge = ridge
        self.devices: dict[str, _DeviceState] = {}

    # -- fitting -------------------------------------------------------------------------------

    def fit(self, observations: Sequence[Observation]) -> LatencyPredictor:
        """Fit population rates and every profiled device's own rates on ``observations``."""
        if not observations:
            raise PredictorError("cannot fit the latency predictor on no observations")
        _check_times(observations)
        names = sorted({o.device for o in observations})
        rows = feature_matrix([o.features for o in observations], [o.micro_batch for o in observations])
        device_of = np.array([names.index(o.device) for o in observations])
        self.devices = {}
        bases = np.zeros((len(names), 2, len(COLUMNS)))
        for direction in range(2):
            times = np.array([o.times()[direction] for o in observations])
            self.population[direction], scales = _fit_population(rows, times, device_of, len(names))
            for k in range(len(names)):
                mine = device_of == k
                bases[k, direction] = _fit_device(rows[mine], times[mine], scales[k] * self.population[direction],
                                                  self.ridge)
        for k, name in enumerate(names):
            self.devices[name] = self._fresh_state(bases[k], fitted=True)
        return self

    def add_device(self, name: str, scale: float = 1.0) -> None:
        """Register an unseen device as the population ``scale`` times slower (1.0: unknown)."""
        if not scale > 0:
            raise PredictorError(f"device {name!r}: scale must be positive (got {scale})")
        if not self.population.any():
            raise PredictorError("the predictor is not fitted: call fit(observations) first")
        self.devices[name] = self._fresh_state(self.population * scale, fitted=False)

    def calibrate(self, name: str, features: Features, micro_batch: int, forward_ms: float,
                  backward_ms: float) -> float:
        """Register an unseen device scaled to match one measured stage; returns the scale."""
        _check_measured(name, forward_ms, backward_ms)
        row = design_row(features, micro_batch)
        predicted = float(row @ self.population[0] + row @ self.population[1])
        if not predicted > 0:
            raise PredictorError(f"device {name!r}: the population predicts 0 ms for the calibration stage")
        scale = (forward_ms + backward_ms) / predicted
        self.add_device(name, scale)
        return scale

    def _fresh_state(self, base: np.ndarray, fitted: bool) -> _DeviceState:
        s = self.settings
        speed_sd, mix_sd = (s.fitted_speed_sd, s.fitted_mix_sd) if fitted else (s.unseen_speed_sd, s.unseen_mix_sd)
        prior = np.diag([speed_sd ** 2] + [mix_sd ** 2] * len(COLUMNS))
        return _DeviceState(base=np.array(base, float), mean=np.zeros((2, 1 + len(COLUMNS))),
                            cov=np.stack([prior, prior]), fitted=fitted)

    # -- predicting ------------------------------------------------------------------------------

    def predict(self, device: str, features: Features, micro_batch: int) -> tuple[float, float]:
        """Forward and backward ms of a stage (or block) with ``features`` on ``device``."""
        rates = self._state(device).rates()
        row = design_row(features, micro_batch)
        return float(row @ rates[0]), float(row @ rates[1])

    def predict_many(self, device: str, features: Sequence[Features], micro_batches: Sequence[int]) -> np.ndarray:
        """Predictions for many stages at once: an array (n, 2) of forward and backward ms."""
        rates = self._state(device).rates()
        return feature_matrix(list(features), list(micro_batches)) @ rates.T

    def rates(self, device: str) -> dict[str, dict[str, float]]:
        """The device's current rates by column, per direction (ms per unit), for reports."""
        rates = self._state(device).rates()
        return {d: dict(zip(COLUMNS, map(float, rates[k]))) for k, d in enumerate(DIRECTIONS)}

    def _state(self, device: str) -> _DeviceState:
        if device not in self.devices:
            known = ", ".join(sorted(self.devices)) or "none"
            raise PredictorError(f"unknown device {device!r}; known devices: {known} (add_device registers one)")
        return self.devices[device]

    # -- learning online -------------------------------------------------------------------------

    def observe(self, device: str, features: Features, micro_batch: int, forward_ms: float | None,
                backward_ms: float) -> None:
        """Refine ``device``'s rates from one measured stage (an unknown device is added first).

        ``forward_ms`` is None when the stage runs no separate forward (a pipeline's last stage).
        """
        _check_measured(device, backward_ms if forward_ms is None else forward_ms, backward_ms)
        row = design_row(features, micro_batch)
        if device not in self.devices:
            self.add_device(device)
        state = self.devices[device]
        for direction, measured in enumerate((forward_ms, backward_ms)):
            if measured is not None:
                self._filter_step(state, direction, row, measured)
        state.observations += 1

    def _filter_step(self, state: _DeviceState, direction: int, row: np.ndarray, measured: float) -> None:
        """One extended-Kalman step in log space: log t = log sum_j base_j e^(a + b_j) x_j."""
        s = self.settings
        mean, cov = state.mean[direction], state.cov[direction]
        cov += np.diag([s.speed_drift_sd ** 2] + [s.mix_drift_sd ** 2] * len(COLUMNS))
        contributions = state.base[direction] * np.exp(mean[0] + mean[1:]) * row
        predicted = contributions.sum()
        if not predicted > 0:
            return
        jacobian = np.concatenate([[1.0], contributions / predicted])
        innovation = np.log(measured) - np.log(predicted)
        spread = jacobian @ cov @ jacobian + s.measurement_sd ** 2
        if innovation ** 2 > s.surprise_sd ** 2 * spread:  # the device changed speed: re-open its prior
            cov[0, 0] += s.unseen_speed_sd ** 2
            spread = jacobian @ cov @ jacobian + s.measurement_sd ** 2
        gain = cov @ jacobian / spread
        mean += gain * innovation
        cov -= np.outer(gain, jacobian @ cov)
        state.cov[direction] = (cov + cov.T) / 2

    # -- storing ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Everything needed to predict and keep learning, as JSON (stored next to devices.json)."""
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "columns": list(COLUMNS), "ridge": self.ridge,
            "settings": vars(self.settings), "population": self.population.tolist(),
            "devices": {name: {"base": st.base.tolist(), "mean": st.mean.tolist(), "cov": st.cov.tolist(),
                               "fitted": st.fitted, "observations": st.observations}
                        for name, st in self.devices.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LatencyPredictor:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PredictorError(f"not an edgert predictor file (expected format {FORMAT!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise PredictorError(f"predictor file version {data.get('format_version')!r} is not supported")
        if data.get("columns") != list(COLUMNS):
            raise PredictorError(f"predictor file columns {data.get('columns')} differ from {list(COLUMNS)}")
        try:
            predictor = cls(np.array(data["population"], float), OnlineSettings(**data["settings"]),
                            float(data["ridge"]))
            predictor.devices = {
                name: _DeviceState(base=np.array(d["base"], float), mean=np.array(d["mean"], float),
                                   cov=np.array(d["cov"], float), fitted=bool(d["fitted"]),
                                   observations=int(d["observations"]))
                for name, d in data["devices"].items()}
        except (KeyError, TypeError, ValueError) as error:
            raise PredictorError(f"predictor file is malformed: {type(error).__name__}: {error}") from None
        return predictor


def save_predictor(predictor: LatencyPredictor, path: str | Path) -> Path:
    """Write the predictor as JSON (conventionally ``predictor.json`` next to ``devices.json``)."""
    path = Path(path)
    path.write_text(json.dumps(predictor.to_json()) + "\n")
    return path


def load_predictor(path: str | Path) -> LatencyPredictor:
    path = Path(path)
    if not path.is_file():
        raise PredictorError(f"{path}: no such predictor file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PredictorError(f"{path}: not valid JSON ({error})") from None
    return LatencyPredictor.from_json(data)


def mape(predicted: np.ndarray | Sequence[float], measured: np.ndarray | Sequence[float]) -> float:
    """Mean absolute percentage error of ``predicted`` against ``measured`` (0.1 = 10%)."""
    predicted, measured = np.asarray(predicted, float).ravel(), np.asarray(measured, float).ravel()
    if predicted.shape != measured.shape or not measured.size:
        raise PredictorError(f"mape needs equal, non-empty sizes (got {predicted.size} and {measured.size})")
    if not (measured > 0).all():
        raise PredictorError(f"mape needs positive measured times (got min {measured.min()})")
    return float(np.mean(np.abs(predicted - measured) / measured))


def nnls(matrix: np.ndarray, target: np.ndarray, iterations: int | None = None) -> np.ndarray:
    """Non-negative least squares, min |A x - b| with x >= 0 (Lawson-Hanson active set)."""
    a, b = np.asarray(matrix, float), np.asarray(target, float)
    norms = np.linalg.norm(a, axis=0)
    usable = norms > 0
    scaled = a[:, usable] / norms[usable]
    columns = scaled.shape[1]
    x, passive = np.zeros(columns), np.zeros(columns, bool)
    for _ in range(iterations or 3 * columns + 10):
        gradient = scaled.T @ (b - scaled @ x)
        candidates = ~passive & (gradient > 1e-12)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(columns)
            z[passive] = np.linalg.lstsq(scaled[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            step = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + step * (z - x)
            passive &= x > 1e-12
            x[~passive] = 0
    result = np.zeros(a.shape[1])
    result[usable] = x / norms[usable]
    return result


def _check_measured(device: str, forward_ms: float, backward_ms: float) -> None:
    for value, what in ((forward_ms, "forward_ms"), (backward_ms, "backward_ms")):
        if not (np.isfinite(value) and value > 0):
            raise PredictorError(f"device {device!r}: {what} must be a positive time (got {value})")


def _check_times(observations: Sequence[Observation]) -> None:
    for o in observations:
        if not (o.forward_ms > 0 and o.backward_ms > 0 and o.micro_batch >= 1):
            raise PredictorError(f"observation {o.device}/{o.model}/{o.stage}: times must be positive and "
                                 f"micro-batch >= 1 (got {o.forward_ms}, {o.backward_ms}, mb {o.micro_batch})")


def _fit_population(rows: np.ndarray, times: np.ndarray, device_of: np.ndarray,
                    devices: int, rounds: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Rates shared by all devices up to one speed factor each, in relative error."""
    scales = np.ones(devices)
    rates = np.zeros(rows.shape[1])
    for _ in range(rounds):
        relative = rows * (scales[device_of] / times)[:, None]
        rates = nnls(relative, np.ones(len(times)))
        predicted = rows @ rates
        for k in range(devices):
            mine = (device_of == k) & (predicted > 0)
            if mine.any():
                ratio = predicted[mine] / times[mine]
                scales[k] = ratio.sum() / (ratio ** 2).sum()
        norm = np.exp(np.mean(np.log(scales)))
        scales, rates = scales / norm, rates * norm
    return rates, scales


def _fit_device(rows: np.ndarray, times: np.ndarray, prior: np.ndarray, ridge: float) -> np.ndarray:
    """A device's own rates: relative least squares, pulled towards ``prior`` by ``ridge``."""
    relative = rows / times[:, None]
    weight = np.sqrt(ridge * len(times)) * relative.mean(axis=0)
    matrix = np.vstack([relative, np.diag(weight)])
    target = np.concatenate([np.ones(len(times)), weight * prior])
    return nnls(matrix, target)
