"""Hops as a training run met them: from a run's ``trace.json``, how long a late input took to arrive.

The idle hop (:mod:`edgert.bench.hop`) is one message between two otherwise idle processes. In a
pipeline the same path shares the machine with every other worker's compute, loop and sleeping
emulated device, so a hop there can cost several times as much. For every wait of a stage for
its input (a ``wait act`` or ``wait grad`` span followed by the computation it waited for), this
takes the time from the end of the neighbour's computation that produced the input (its
``F{step}.{micro-batch}`` or ``B{step}.{micro-batch}`` span) to the end of the wait: the hop as
the waiting stage saw it (encode, hand-over to the loop, the wire, receive, decode, the compute
thread's wake). Waits that ended before the input was produced are not hops (they waited for
something else) and are left out, as are stages held by groups (several tracks per stage).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from edgert.coordinator.tracefile import read_trace

#: The wait's kind -> (the neighbour that produced the input, relative to the waiting stage; its span's letter).
SOURCES = {"wait act": (-1, "F"), "wait grad": (+1, "B")}


def trace_hops(trace: Path, skip_steps: int = 0) -> dict[str, Any]:
    """Median, 10th and 90th percentile (ms) of the hops of steps ``skip_steps`` on, by kind and all together."""
    spans = [e for e in read_trace(trace) if e.get("ph") == "X"]
    tracks: dict[int, list[dict[str, Any]]] = {}
    stage_tracks: dict[int, set[int]] = {}
    for event in spans:
        tracks.setdefault(event["tid"], []).append(event)
        stage_tracks.setdefault(event["args"]["stage"], set()).add(event["tid"])
    ends = {(e["args"]["stage"], e["name"]): e["ts"] + e["dur"] for e in spans if e["name"][0] in "FB"}
    hops: dict[str, list[float]] = {kind: [] for kind in SOURCES}
    for events in tracks.values():
        events.sort(key=lambda e: e["ts"])
        for index, wait in enumerate(events):
            if wait["name"] not in SOURCES:
                continue
            stage = wait["args"]["stage"]
            computed = next((e for e in events[index + 1:] if e["name"][0] in "FB"), None)
            offset, letter = SOURCES[wait["name"]]
            if computed is None or len(stage_tracks.get(stage, ())) > 1 or \
                    len(stage_tracks.get(stage + offset, ())) > 1:
                continue
            key = computed["name"][1:]  # "step.micro-batch"
            if int(key.split(".")[0]) < skip_steps:
                continue
            produced = ends.get((stage + offset, letter + key))
            waited_until = wait["ts"] + wait["dur"]
            if produced is not None and produced < waited_until:
                hops[wait["name"]].append((waited_until - produced) / 1000)
    every = hops["wait act"] + hops["wait grad"]
    figures: dict[str, Any] = {"hops": len(every)}
    for name, values in (("act", hops["wait act"]), ("grad", hops["wait grad"]), ("all", every)):
        if values:
            values.sort()
            figures[f"{name}_median_ms"] = round(statistics.median(values), 3)
            figures[f"{name}_p10_ms"] = round(values[len(values) // 10], 3)
            figures[f"{name}_p90_ms"] = round(values[9 * len(values) // 10], 3)
    return figures
