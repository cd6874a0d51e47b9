#!/usr/bin/env python3
"""Latency predictor evaluation: its error on held-out models and on unseen devices.

1. Profiles: every zoo model and the predictor's extra fitting models
   (``models/fitting_set.py``), each block as its own stage (a "units" plan) and
   the stages of a balanced 2-stage plan, measured through the real stage runtime on four
   emulated devices of this host: ``t11`` (1 forward / 1 backward ORT thread), ``t12``,
   ``t21``, and ``t11-x3`` (t11 emulated 3x slower), at micro-batches 4, 16 and 64.
2. ``mape_heldout_model``: leave-one-model-out over the zoo. The predictor is fitted on
   every other model (zoo and extra) on all devices, then predicts the held-out model's
   blocks on each device; MAPE over blocks x devices x micro-batches x {forward, backward},
   averaged over the zoo's models (``_pooled``: over all their blocks, which weighs a
   25-block model five times a 5-block one).
   ``mape_heldout_model_stages`` does the same for the multi-block stages of its 2-stage plan.
3. ``mape_unseen_device_k{0,3,10}``: for each device D and zoo model M, the predictor is
   fitted without D and without M; D starts from the population rates (scale 1.0) and
   observes k stage times of M on D (random stages and micro-batches of M, seeded); the
   error is on M's blocks on D that were not observed, averaged over D, M and 3 seeds.
4. ``mape_heldout_model_flops_only``: the same leave-one-model-out for a per-device cost per
   call plus a rate times FLOPs (the cost model behind FLOP-balanced cuts), for comparison.
5. ``mape_fit``: fitted on everything, error on everything (the model's bias floor), and
   ``measurement_noise_halves``: how far apart the fastest of the odd and of the even
   profiling passes are, on average (each half alone is noisier than their minimum).

Usage: python tools/eval_predictor.py [--json] [--cache FILE] [--regenerate]
The measured profiles are cached (default: a file in the system temp folder); timing on a
shared 2-core host is noisy, so figures move by a point or two between generations.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgert.exporter.predictor.latency import LatencyPredictor, Observation, nnls
from edgert.exporter.predictor.observations import (
    analyse_model,
    load_observations,
    profile_models,
    refresh_features,
    save_observations,
)
from edgert.models import build_model, list_models
from edgert.models.fitting_set import EXTRA_MODELS

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "edgert-predictor-profiles.json"
ONLINE_STEPS = (0, 3, 10)
SEEDS = (0, 1, 2)


def zoo_names() -> list[str]:
    return [spec.name for spec in list_models()]


def builders() -> dict:
    return {**{name: (lambda n=name: build_model(n)) for name in zoo_names()}, **EXTRA_MODELS}


def observations(cache: Path, regenerate: bool) -> tuple[list[Observation], float]:
    """The cached profiles (features computed afresh), or new ones (and the seconds they took)."""
    if cache.is_file() and not regenerate:
        cached = load_observations(cache)
        models = builders()
        if {o.model for o in cached} == set(models):
            analyses = {name: analyse_model(build(), name) for name, build in models.items()}
            return refresh_features(cached, analyses), 0.0
        print(f"{cache}: profiles other models than {sorted(models)}; measuring again", file=sys.stderr)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        measured = profile_models(builders(), Path(workdir), stage_counts=(2,),
                                  progress=lambda line: print(line, file=sys.stderr))
    seconds = time.perf_counter() - started
    save_observations(measured, cache)
    return measured, seconds


def _is_unit(o: Observation) -> bool:
    return "+" not in o.stage


def _errors(predictor: LatencyPredictor, tests: list[Observation]) -> np.ndarray:
    """Absolute percentage errors, shape (n, 2): forward and backward."""
    predicted = np.array([predictor.predict(o.device, o.features, o.micro_batch) for o in tests])
    measured = np.array([o.times() for o in tests])
    return np.abs(predicted - measured) / measured


def heldout_models(data: list[Observation]) -> tuple[list[dict], dict[str, float]]:
    rows, units, stages = [], [], []
    for model in zoo_names():
        predictor = LatencyPredictor().fit([o for o in data if o.model != model])
        unit_errors = _errors(predictor, [o for o in data if o.model == model and _is_unit(o)])
        stage_errors = _errors(predictor, [o for o in data if o.model == model and not _is_unit(o)])
        units.append(unit_errors)
        stages.append(stage_errors)
        rows.append({"kind": "heldout_model", "model": model, "blocks": len(unit_errors),
                     "mape_forward": float(unit_errors[:, 0].mean()), "mape_backward": float(unit_errors[:, 1].mean()),
                     "mape": float(unit_errors.mean()),
                     "mape_stages": float(stage_errors.mean()) if len(stage_errors) else None})
    units_all = np.concatenate(units)
    return rows, {"mape_heldout_model": float(np.mean([r["mape"] for r in rows])),
                  "mape_heldout_model_pooled": float(units_all.mean()),
                  "mape_heldout_model_forward": float(units_all[:, 0].mean()),
                  "mape_heldout_model_backward": float(units_all[:, 1].mean()),
                  "mape_heldout_model_stages": float(np.concatenate(stages).mean())}


def flops_baseline(data: list[Observation]) -> dict[str, float]:
    """Leave-one-model-out for time = per-call cost + device rate x FLOPs x micro-batch, per device."""
    per_model = []
    for model in zoo_names():
        errors = []
        for device in sorted({o.device for o in data}):
            train = [o for o in data if o.model != model and o.device == device]
            tests = [o for o in data if o.model == model and o.device == device and _is_unit(o)]
            rows = np.array([[1.0, o.features.flops * o.micro_batch] for o in train])
            test_rows = np.array([[1.0, o.features.flops * o.micro_batch] for o in tests])
            for direction in range(2):
                times = np.array([o.times()[direction] for o in train])
                rates = nnls(rows / times[:, None], np.ones(len(times)))
                measured = np.array([o.times()[direction] for o in tests])
                errors += list(np.abs(test_rows @ rates - measured) / measured)
        per_model.append(np.mean(errors))
    return {"mape_heldout_model_flops_only": float(np.mean(per_model))}


def unseen_devices(data: list[Observation]) -> tuple[list[dict], dict[str, float]]:
    rows, by_steps = [], {k: [] for k in ONLINE_STEPS}
    for device in sorted({o.device for o in data}):
        device_errors = {k: [] for k in ONLINE_STEPS}
        for model in zoo_names():
            fitted = LatencyPredictor().fit([o for o in data if o.device != device and o.model != model])
            mine = [o for o in data if o.device == device and o.model == model]
            for seed in SEEDS:
                order = np.random.default_rng(seed).permutation(len(mine))
                for steps in ONLINE_STEPS:
                    predictor = LatencyPredictor.from_json(fitted.to_json())
                    predictor.add_device(device)
                    for index in order[:steps]:
                        o = mine[index]
                        predictor.observe(device, o.features, o.micro_batch, o.forward_ms, o.backward_ms)
                    seen = set(order[:steps].tolist())
                    tests = [o for i, o in enumerate(mine) if i not in seen and _is_unit(o)]
                    device_errors[steps].append(_errors(predictor, tests).mean())
        for steps in ONLINE_STEPS:
            value = float(np.mean(device_errors[steps]))
            by_steps[steps].append(value)
            rows.append({"kind": "unseen_device", "device": device, "observations": steps, "mape": value})
    return rows, {f"mape_unseen_device_k{k}": float(np.mean(v)) for k, v in by_steps.items()}


def fit_floor(data: list[Observation]) -> dict[str, float]:
    predictor = LatencyPredictor().fit(data)
    return {"mape_fit": float(_errors(predictor, data).mean())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print {rows, ratios} as JSON")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="profiles file to reuse or write")
    parser.add_argument("--regenerate", action="store_true", help="measure again even if the cache exists")
    args = parser.parse_args(argv)
    data, seconds = observations(args.cache, args.regenerate)
    model_rows, model_ratios = heldout_models(data)
    device_rows, device_ratios = unseen_devices(data)
    ratios = {**model_ratios, **flops_baseline(data), **device_ratios, **fit_floor(data),
              "measurement_noise_halves": float(np.mean([o.spread for o in data])), "observations": len(data),
              "devices": len({o.device for o in data}), "models": len({o.model for o in data}),
              "profile_seconds": round(seconds, 1)}
    rows = model_rows + device_rows
    if args.json:
        print(json.dumps({"rows": rows, "ratios": ratios}, indent=2))
    else:
        _print_table(model_rows, device_rows, ratios)
    return 0


def _print_table(model_rows: list[dict], device_rows: list[dict], ratios: dict) -> None:
    print(f"{'held-out model':<20} {'blocks':>6} {'fwd':>7} {'bwd':>7} {'all':>7} {'stages':>7}")
    for r in model_rows:
        stages = f"{r['mape_stages']:7.1%}" if r["mape_stages"] is not None else f"{'-':>7}"
        print(f"{r['model']:<20} {r['blocks']:>6} {r['mape_forward']:7.1%} {r['mape_backward']:7.1%} "
              f"{r['mape']:7.1%} {stages}")
    print()
    print(f"{'unseen device':<20} " + " ".join(f"{'k=' + str(k):>7}" for k in ONLINE_STEPS))
    for device in dict.fromkeys(r["device"] for r in device_rows):
        values = [r["mape"] for r in device_rows if r["device"] == device]
        print(f"{device:<20} " + " ".join(f"{v:7.1%}" for v in values))
    print()
    for name, value in ratios.items():
        print(f"{name:<32} {value:.4f}" if isinstance(value, float) else f"{name:<32} {value}")


if __name__ == "__main__":
    sys.exit(main())
