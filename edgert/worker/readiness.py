"""Is this board ready to be a worker? (``edgert doctor``; platforms/README.md)

Checks what a worker needs before the coordinator finds out the hard way: the Python,
one stock onnxruntime (never next to the training build) with the execution providers
asked for, the credential, the listen port, a writable work folder; and, given a plan
exported on the host, that every stage of it loads and trains one micro-batch here.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgert.errors import EdgertError
from edgert.transport.coap_tcp import DEFAULT_PORT
from edgert.worker.machine import memory_bytes, usable_cores

OK, WARN, FAIL = "ok", "warn", "FAIL"
MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was checked, how it went, what was seen."""

    what: str
    status: str
    detail: str


@dataclass(frozen=True)
class ReadinessOptions:
    """What to check besides the basics (each None: not checked)."""

    providers: str = "cpu"
    credential: Path | None = None
    listen_port: int | None = DEFAULT_PORT
    workdir: Path | None = None
    plan: Path | None = None
    micro_batch: int = 8


def check_board(options: ReadinessOptions) -> Iterator[Finding]:
    """Every finding, in order; the caller stops at nothing (a FAIL is reported, not raised)."""
    yield _python()
    yield _machine()
    yield _guarded("onnxruntime", _onnxruntime)
    yield _guarded("providers", lambda: _providers(options.providers))
    if options.credential is not None:
        yield _guarded("credential", lambda: _credential(options.credential))
    if options.listen_port is not None:
        yield _port(options.listen_port)
    yield _guarded("work folder", lambda: _workdir(options.workdir))
    if options.plan is not None:
        yield from _plan(options.plan, options.providers, options.micro_batch)


def _guarded(what: str, check: Callable[[], Finding]) -> Finding:
    try:
        return check()
    except EdgertError as error:
        return Finding(what, FAIL, str(error))


def _python() -> Finding:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return Finding("python", FAIL, f"{version}: the worker needs Python {'.'.join(map(str, MIN_PYTHON))} or newer")
    return Finding("python", OK, f"{version} ({sys.executable})")


def _machine() -> Finding:
    memory = memory_bytes("MemTotal")
    shown = f", {memory / 2**30:.1f} GiB memory" if memory else ""
    cores, machine_cores = usable_cores(), os.cpu_count()
    of = f" of {machine_cores}" if machine_cores and machine_cores != cores else ""
    return Finding("machine", OK, f"{platform.machine()}, {cores}{of} cores{shown}, {platform.platform()}")


def _onnxruntime() -> Finding:
    from edgert.ort_import import onnxruntime, training_folder

    module = onnxruntime()
    kind = "the training build (host)" if training_folder() else "stock"
    return Finding("onnxruntime", OK, f"{module.__version__}, {kind}, from {Path(module.__file__).parent}")


def _providers(requested: str) -> Finding:
    from edgert.providers import check_available, parse_providers

    chosen = check_available(parse_providers(requested))
    return Finding("providers", OK, " > ".join(chosen))


def _credential(path: Path) -> Finding:
    from edgert.transport.tls import TlsCredentials

    credentials = TlsCredentials.load(path)
    oscore = "with" if credentials.oscore else "without"
    return Finding("credential", OK, f"{credentials.identity} from {path} ({oscore} OSCORE keys)")


def _port(port: int) -> Finding:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as error:
            return Finding("listen port", WARN, f"{port} is taken ({error.strerror}): is a worker already running?")
    return Finding("listen port", OK, f"{port} is free")


def _workdir(workdir: Path | None) -> Finding:
    folder = Path(workdir) if workdir else Path(tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise EdgertError(f"{folder} is not writable")
    free = shutil.disk_usage(folder).free
    status = WARN if free < 256 * 2**20 else OK
    return Finding("work folder", status, f"{folder}, {free / 2**30:.1f} GiB free")


def _plan(plan: Path, providers: str, micro_batch: int) -> Iterator[Finding]:
    """Each stage of ``plan``: its graphs load with this onnxruntime, and one micro-batch trains."""
    from edgert.manifest import MEMORY_MODES, load_manifest
    from edgert.providers import check_available, parse_providers
    from edgert.stage import StageSession

    try:
        manifest = load_manifest(plan)
        chosen = check_available(parse_providers(providers))
    except EdgertError as error:
        yield Finding("plan", FAIL, str(error))
        return
    rng = np.random.default_rng(0)
    for entry in manifest.stages:
        for mode in MEMORY_MODES:
            if mode == "stash" and entry.is_last:
                continue
            what = f"plan stage {entry.index} ({mode})"
            try:
                session = StageSession(entry, plan, manifest.training, memory_mode=mode, providers=chosen)
                inputs = {t.name: t.sample(rng, micro_batch) for t in entry.inputs}
                grads = {t.name: t.sample(rng, micro_batch) for t in entry.outputs
                         if t.name in entry.output_gradients}
                labels = {t.name: t.sample(rng, micro_batch) for t in entry.labels} or None
                start = time.perf_counter()
                session.train_micro_batch(inputs, grads or None, labels)
                session.step()
                took = (time.perf_counter() - start) * 1e3
            except Exception as error:  # noqa: BLE001 - ORT raises many types; each is this stage's failure
                yield Finding(what, FAIL, str(error).strip().splitlines()[-1][:300])
                continue
            yield Finding(what, OK, f"forward + backward + step of {micro_batch} samples in {took:.1f} ms "
                                    f"(first call, includes warm-up)")
