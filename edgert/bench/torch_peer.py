"""The peer users would reach for: ``torch.distributed.pipelining`` training the pipeline benchmark's shape.

``mlp-deep`` (embed, 24 layers, head: edgert/models/mlp_deep.py) rebuilt in PyTorch with the
same block widths, cut into the same stages as edgert's plan (block counts per stage), each
stage in its own process (gloo on loopback, the CPU, one thread per process, as an edgert
worker computes), trained with ``Schedule1F1B`` on the same digits batches with AdamW at the
plan's learning rate. Only the throughput is compared (samples/s over the steps after a
warm-up); torch is optional: :func:`available` says whether this peer can run here.
"""

from __future__ import annotations

import importlib.util
import socket
import time
from dataclasses import dataclass

import numpy as np

from edgert.models.mlp_deep import LAYERS, WIDTH

INPUTS, CLASSES = 64, 10  # mlp-deep's, on the flattened digits (edgert.models' registry)


@dataclass(frozen=True)
class PeerRun:
    """What one torch pipelining run is asked to do."""

    stage_blocks: tuple[int, ...]  # blocks per stage, in order (embed, layer0..layer23, head)
    micro_batches: int
    batch_size: int
    steps: int
    warmup: int
    learning_rate: float
    port: int


def available() -> bool:
    """Whether torch (with torch.distributed.pipelining) is installed here."""
    return importlib.util.find_spec("torch") is not None


def samples_per_s(x: np.ndarray, y: np.ndarray, stage_blocks: list[int], micro_batches: int, batch_size: int,
                  steps: int, learning_rate: float, warmup: int = 3) -> float:
    """Train ``steps`` steps (after ``warmup``) in ``len(stage_blocks)`` processes; rank 0's samples/s."""
    import torch.multiprocessing as mp

    if x.ndim != 2 or x.shape[1] != INPUTS:
        raise ValueError(f"the peer trains mlp-deep on flat digits ([N, {INPUTS}]), not inputs of shape {x.shape}")
    run = PeerRun(tuple(stage_blocks), micro_batches, batch_size, steps, warmup, learning_rate, _free_port())
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_stage_process, args=(run, x, y, results), nprocs=len(stage_blocks), start_method="spawn")
    return float(results.get())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _blocks(torch_nn) -> list:
    """mlp-deep's blocks as torch modules, in graph order."""
    blocks = [torch_nn.Sequential(torch_nn.Linear(INPUTS, WIDTH), torch_nn.ReLU())]
    blocks += [torch_nn.Sequential(torch_nn.Linear(WIDTH, WIDTH), torch_nn.ReLU()) for _ in range(LAYERS)]
    return [*blocks, torch_nn.Linear(WIDTH, CLASSES)]


def _stage_process(rank: int, run: PeerRun, x: np.ndarray, y: np.ndarray, results) -> None:
    """One pipeline stage: its blocks, its part of 1F1B, AdamW; rank 0 reports the rate."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    torch.manual_seed(0)
    stages = len(run.stage_blocks)
    dist.init_process_group("gloo", rank=rank, world_size=stages, init_method=f"tcp://127.0.0.1:{run.port}")
    try:
        blocks = _blocks(nn)
        first = sum(run.stage_blocks[:rank])
        module = nn.Sequential(*blocks[first:first + run.stage_blocks[rank]])
        stage = PipelineStage(module, rank, stages, torch.device("cpu"))  # shapes inferred at the first step
        schedule = Schedule1F1B(stage, run.micro_batches, loss_fn=nn.functional.cross_entropy)
        optimizer = torch.optim.AdamW(module.parameters(), lr=run.learning_rate)
        inputs, labels = torch.from_numpy(x), torch.from_numpy(y)
        started = 0.0
        for step in range(run.warmup + run.steps):
            if step == run.warmup:
                dist.barrier()
                started = time.perf_counter()
            rows = slice((step * run.batch_size) % (len(x) - run.batch_size),
                         (step * run.batch_size) % (len(x) - run.batch_size) + run.batch_size)
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(inputs[rows])
            elif rank == stages - 1:
                schedule.step(target=labels[rows], losses=[])
            else:
                schedule.step()
            optimizer.step()
        dist.barrier()
        if rank == 0:
            results.put(run.steps * run.batch_size / (time.perf_counter() - started))
    finally:
        dist.destroy_process_group()
