"""One pipeline stage: forward, forward+backward, optimizer step, and its state by name.

The forward runs the eval graph (training-form normalisation, so it matches the forward
the backward recomputes); the backward runs the gradient graph, which recomputes the
forward (activation checkpointing at stage granularity) and returns the gradients of the
parameters and of the stage's inputs. Both are ORT training graphs run in plain
``InferenceSession``s: unlike ORT's ``Module``, ``InferenceSession.run`` releases the GIL,
so the worker's transport keeps serving while a stage computes. The parameters are numpy
arrays owned here, fed to ORT by reference and stepped in place by the optimizer.

With ``split_backward`` (where the plan has the halves: exporter/weight_split.py) a micro-batch's
backward computes only what the pipeline waits for; the parameter gradients of all the step's
micro-batches are computed at once, by :meth:`StageSession.finish_weights`, before the step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgert.errors import StageError
from edgert.manifest import MEMORY_MODES, BoundaryTensor, StageEntry, TrainingConfig, split_roles
from edgert.optimizer import FlatParameters, Optimizer, StateDict, make_optimizer
from edgert.ort_import import onnxruntime
from edgert.providers import DEFAULT_PROVIDERS, confirm_loaded
from edgert.weights import load_state

LOSS_SCALE_INPUT = "loss_scale"
SCALED_LOSS_OUTPUT = "scaled_loss"
LOSS_OUTPUT = "loss"
GRADIENT_SUFFIX = "_grad"


@dataclass(frozen=True)
class Threads:
    """ORT intra-op threads for the forward (eval) and backward (gradient) sessions."""

    forward: int = 1
    backward: int = 1


@dataclass
class BackwardResult:
    """What one micro-batch's backward produced."""

    loss: float | None
    prediction: np.ndarray | None
    input_gradients: dict[str, np.ndarray]


def _session(path: Path, threads: int, providers: tuple[str, ...]):
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=list(providers))
    confirm_loaded(session, providers, path.name)
    return session


class StageSession:
    """A stage's sessions, its parameters, accumulated gradients and optimizer."""

    def __init__(self, entry: StageEntry, plan_dir: str | Path, training: TrainingConfig,
                 threads: Threads = Threads(), memory_mode: str = "recompute",
                 providers: tuple[str, ...] = DEFAULT_PROVIDERS, split_backward: bool = False):
        if memory_mode not in MEMORY_MODES:
            raise StageError(f"memory mode {memory_mode!r} is not one of {', '.join(MEMORY_MODES)}")
        self.entry = entry
        # The last stage's forward is folded into its backward: nothing to stash there.
        self.stashing = memory_mode == "stash" and not entry.is_last
        self.training = training
        self.threads = threads
        self.providers = providers
        self.single_threaded = threads.forward == threads.backward == 1
        plan_dir = Path(plan_dir)
        self._plan_dir = plan_dir
        self._trainable = [p.name for p in entry.parameters if p.trainable]
        self._buffers = [p.name for p in entry.parameters if not p.trainable]
        initial = self._load_parameters(plan_dir / entry.artifact("parameters").path)
        self._flat = FlatParameters({n: initial[n] for n in self._trainable})
        self._values = {**self._flat.views, **{n: initial[n] for n in self._buffers}}
        self._gradient = self._flat.zeros()
        # each trainable parameter's gradient output and its piece of the flat gradient (a call adds into it)
        self._gradient_pieces = [(name + GRADIENT_SUFFIX, self._flat.piece(self._gradient, name))
                                 for name in self._trainable]
        self._accumulated = 0
        forward_role, backward_role = ("forward_stash", "backward_stash") if self.stashing else ("eval", "backward")
        halves = split_roles(entry, "stash" if self.stashing else "recompute") if split_backward else ()
        self.splits = bool(halves)  # whether the parameter gradients wait for finish_weights
        if halves:
            backward_role = halves[0]
        self._forward = _session(plan_dir / entry.artifact(forward_role).path, threads.forward, providers)
        self._backward = _session(plan_dir / entry.artifact(backward_role).path, threads.backward, providers)
        self._weight = _session(plan_dir / entry.artifact(halves[1]).path, threads.backward, providers) \
            if halves else None
        # what the weight half reads of each micro-batch (the rest are parameters), and each one's values until then
        self._weight_rows = [i.name for i in self._weight.get_inputs() if i.name not in self._flat.views] \
            if self._weight is not None else []
        self._weight_inputs = {i.name for i in self._weight.get_inputs()} if self._weight is not None else set()
        self._weight_outputs = [o.name for o in self._weight.get_outputs()] if self._weight is not None else []
        self._deferred: list[dict[str, np.ndarray]] = []
        self._infer = None
        self._forward_inputs = {i.name for i in self._forward.get_inputs()}
        self._backward_inputs = {i.name for i in self._backward.get_inputs()}
        self._forward_outputs = [o.name for o in self._forward.get_outputs()]
        self._backward_outputs = [o.name for o in self._backward.get_outputs()]
        # whether the backward call returns parameter gradients (all of them, or a split one's BatchNorm's)
        self._backward_adds = any(output in self._backward_outputs for output, _ in self._gradient_pieces)
        self._gradient_to_input = {v: k for k, v in entry.input_gradients.items()}
        self.optimizer: Optimizer = make_optimizer(training)
        # Guards parameters and optimizer state: the optimizer writes them, /weights reads them.
        self.lock = threading.RLock()

    def _load_parameters(self, path: Path) -> dict[str, np.ndarray]:
        state = load_state(path)
        values = {}
        for name in self._trainable + self._buffers:
            if name not in state.parameters:
                raise StageError(f"stage {self.entry.index}: {path.name} lacks parameter {name!r}")
            values[name] = np.array(state.parameters[name], dtype=np.float32, copy=True, order="C")
        return values

    # -- running ---------------------------------------------------------------------------

    def forward(self, inputs: Mapping[str, np.ndarray], keep: dict[str, np.ndarray] | None = None
                ) -> dict[str, np.ndarray]:
        """Run the stage's forward on one micro-batch; returns its boundary outputs by name.

        When stashing, the tensors the backward will need are put in ``keep`` (pass them back
        to :meth:`backward`) and the running statistics move here, once per micro-batch.
        """
        feeds = self._checked_feeds(inputs, list(self.entry.inputs))
        feeds.update(self._state_feeds(self._forward_inputs))
        named = dict(zip(self._forward_outputs, self._forward.run(self._forward_outputs, feeds)))
        if self.stashing:
            if keep is None:
                raise StageError(f"stage {self.entry.index} stashes activations: forward needs a `keep` dict")
            self._update_buffers(named)
            keep.update({name: named[name] for name in self.entry.saved})
        return {t.name: named[t.name] for t in self.entry.outputs}

    def backward(self, inputs: Mapping[str, np.ndarray], output_gradients: Mapping[str, np.ndarray] | None = None,
                 labels: Mapping[str, np.ndarray] | None = None, loss_scale: float = 1.0,
                 saved: Mapping[str, np.ndarray] | None = None) -> BackwardResult:
        """Run the backward of one micro-batch (recomputing its forward, unless stashing).

        Middle and first stages take the gradients of their outputs; the last stage takes
        the labels and ``loss_scale`` (micro-batch size / batch size). With stashing,
        ``saved`` is what the forward kept. Parameter gradients accumulate until :meth:`step` (split: what
        their half reads waits for :meth:`finish_weights`).
        """
        expected = list(self.entry.inputs)
        values = dict(inputs)
        if self.entry.is_last:
            if labels is None:
                raise StageError(f"stage {self.entry.index} is the last stage: backward needs labels")
            values.update(labels)
            expected += list(self.entry.labels)
        else:
            for output, grad_input in self.entry.output_gradients.items():
                if output_gradients is None or output not in output_gradients:
                    raise StageError(f"stage {self.entry.index}: backward needs the gradient of {output!r}")
                values[grad_input] = output_gradients[output]
            expected += [BoundaryTensor(self.entry.output_gradients[t.name], t.dtype, t.shape)
                         for t in self.entry.outputs if t.name in self.entry.output_gradients]
        feeds = self._checked_feeds(values, expected)
        if self.entry.is_last:
            feeds[LOSS_SCALE_INPUT] = np.array(loss_scale, dtype=np.float32)
        given = feeds  # what a split backward's weight half may read of this micro-batch
        if self.stashing:
            if saved is None or any(name not in saved for name in self.entry.saved):
                raise StageError(f"stage {self.entry.index} stashes activations: backward needs what forward kept")
            given = {**feeds, **saved}
            feeds = {k: v for k, v in given.items() if k in self._backward_inputs}
        feeds.update(self._state_feeds(self._backward_inputs))
        named = dict(zip(self._backward_outputs, self._backward.run(self._backward_outputs, feeds)))
        if self._weight is not None:
            self._deferred.append({name: named[name] if name in named else given[name] for name in self._weight_rows})
        return self._collect(named)

    def train_micro_batch(self, inputs: Mapping[str, np.ndarray],
                          output_gradients: Mapping[str, np.ndarray] | None = None,
                          labels: Mapping[str, np.ndarray] | None = None, loss_scale: float = 1.0) -> BackwardResult:
        """A micro-batch's forward (not on the last stage) then backward, as a pipeline runs them back to back."""
        kept: dict[str, np.ndarray] = {}
        if not self.entry.is_last:
            self.forward(inputs, kept)
        return self.backward(inputs, output_gradients, labels, loss_scale, saved=kept if self.stashing else None)

    def _state_feeds(self, wanted: set[str]) -> dict[str, np.ndarray]:
        return {name: value for name, value in self._values.items() if name in wanted}

    def _update_buffers(self, named: dict[str, np.ndarray]) -> None:
        with self.lock:
            for output, buffer in self.entry.buffer_updates.items():
                self._values[buffer][...] = named[output]

    def finish_weights(self) -> int:
        """The parameter gradients of the micro-batches whose backward was split, in one call over all their rows;
        returns those rows (0: none waited)."""
        if not self._deferred:
            return 0
        deferred, self._deferred = self._deferred, []
        feeds = {name: np.concatenate([values[name] for values in deferred]) if len(deferred) > 1
                 else deferred[0][name] for name in self._weight_rows}
        rows = len(feeds[self._weight_rows[0]]) if self._weight_rows else 0
        feeds.update(self._state_feeds(self._weight_inputs))
        named = dict(zip(self._weight_outputs, self._weight.run(self._weight_outputs, feeds)))
        with self.lock:
            self._add_gradients(named)
        return rows

    def _collect(self, named: dict[str, np.ndarray]) -> BackwardResult:
        if not self.stashing:
            self._update_buffers(named)
        if self._backward_adds:
            with self.lock:
                self._add_gradients(named)
        loss = float(named[LOSS_OUTPUT]) if LOSS_OUTPUT in named else None
        prediction = named.get(self.entry.outputs[0].name) if self.entry.is_last else None
        gradients = {self._gradient_to_input[k]: v for k, v in named.items() if k in self._gradient_to_input}
        return BackwardResult(loss=loss, prediction=prediction, input_gradients=gradients)

    def _add_gradients(self, named: dict[str, np.ndarray]) -> None:
        """Add one call's parameter gradients to the flat gradient (the first call since a step copies them, and
        zeroes those it lacks: a split backward's halves each return some)."""
        first = not self._accumulated
        for output, piece in self._gradient_pieces:
            value = named.get(output)
            if value is None:
                if first:
                    piece[...] = 0
            elif first:
                piece[...] = value
            else:
                piece += value
        self._accumulated += 1

    def step(self) -> None:
        """Apply the optimizer to the accumulated gradients, then clear them."""
        self.finish_weights()
        with self.lock:
            if not self._accumulated:
                self._gradient[...] = 0
            self.optimizer.step(self._flat, self._gradient)
            self._accumulated = 0

    def zero_grad(self) -> None:
        """Discard the accumulated gradients (and the micro-batches waiting for theirs)."""
        with self.lock:
            self._accumulated = 0
            self._deferred = []

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Forward with inference-form normalisation (running statistics), for evaluation."""
        if self._infer is None:
            self._infer = _session(self._plan_dir / self.entry.artifact("infer").path, 1, self.providers)
        feeds = self._checked_feeds(inputs, list(self.entry.inputs))
        feeds.update(self._values)
        names = [t.name for t in self.entry.outputs]
        return dict(zip(names, self._infer.run(names, feeds)))

    # -- state -----------------------------------------------------------------------------

    def parameters(self, include_buffers: bool = True) -> dict[str, np.ndarray]:
        """Copies of the stage's parameters (and running statistics), by name."""
        names = self._trainable + (self._buffers if include_buffers else [])
        with self.lock:
            return {name: self._values[name].copy() for name in names}

    def weights_snapshot(self) -> np.ndarray:
        """One contiguous copy of the trainable parameters (what weight stashing keeps per version)."""
        with self.lock:
            return self._flat.flat.copy()

    @contextlib.contextmanager
    def stashed_weights(self, snapshot: np.ndarray) -> Iterator[None]:
        """Run with a :meth:`weights_snapshot` as the trainable parameters the graphs read, without copying.

        Gradients still accumulate for, and the optimizer still steps, the live parameters.
        Readers of the parameters wait until the block ends.
        """
        with self.lock:
            live = {name: self._values[name] for name in self._trainable}
            self._values.update({name: self._flat.piece(snapshot, name) for name in self._trainable})
            try:
                yield
            finally:
                self._values.update(live)

    def gradients(self) -> dict[str, np.ndarray]:
        """Copies of the accumulated parameter gradients, by name (zeros before any backward)."""
        self.finish_weights()
        with self.lock:
            if not self._accumulated:
                return {n: np.zeros_like(self._values[n]) for n in self._trainable}
            return {n: self._flat.piece(self._gradient, n).copy() for n in self._trainable}

    def gradient_flat(self) -> np.ndarray:
        """One contiguous copy of the accumulated parameter gradients (zeros before any backward)."""
        self.finish_weights()
        with self.lock:
            return self._gradient.copy() if self._accumulated else np.zeros_like(self._gradient)

    def replace_gradient(self, flat: np.ndarray) -> None:
        """Make ``flat`` (laid out as :meth:`gradient_flat`) the accumulated gradients the next :meth:`step` applies."""
        if flat.shape != self._gradient.shape or flat.dtype != self._gradient.dtype:
            raise StageError(f"stage {self.entry.index}: gradient of shape {list(flat.shape)} {flat.dtype} does not "
                             f"match {list(self._gradient.shape)} {self._gradient.dtype}")
        with self.lock:
            self._gradient[...] = flat
            self._accumulated = max(self._accumulated, 1)
            self._deferred = []

    def running_statistics(self) -> dict[str, np.ndarray]:
        """Copies of the buffers the forward updates (BatchNormalization's running mean and variance), by name."""
        with self.lock:
            return {name: self._values[name].copy() for name in self.entry.buffer_updates.values()}

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters or running statistics by name; unknown names are an error."""
        unknown = [n for n in values if n not in self._values]
        if unknown:
            raise StageError(f"stage {self.entry.index} has no parameter(s) {', '.join(unknown[:5])}")
        for name, value in values.items():
            if self._values[name].shape != tuple(np.shape(value)):
                raise StageError(f"parameter {name!r}: shape {list(np.shape(value))} "
                                 f"does not match {list(self._values[name].shape)}")
        with self.lock:
            for name, value in values.items():
                self._values[name][...] = value

    def optimizer_state(self) -> StateDict:
        with self.lock:
            return self.optimizer.state_dict()

    def load_optimizer_state(self, state: StateDict) -> None:
        unknown = [n for n in state if n not in self._trainable]
        if unknown:
            raise StageError(f"stage {self.entry.index} has no trainable parameter(s) {', '.join(unknown[:5])}")
        with self.lock:
            self.optimizer.load_state_dict(state)

    # -- checking inputs ---------------------------------------------------------------------

    def _checked_feeds(self, values: Mapping[str, np.ndarray], expected: list[BoundaryTensor]) -> dict:
        """The feeds for ``expected``, each checked for name, dtype, shape and one batch size."""
        feeds = {}
        batches: set[int] = set()
        for spec in expected:
            if spec.name not in values:
                raise StageError(f"stage {self.entry.index}: missing input {spec.name!r}")
            value = values[spec.name]
            problem = spec.mismatch(value)
            if problem is not None:
                raise StageError(f"stage {self.entry.index}: input {spec.name!r} {problem}")
            batches.update(spec.batch_sizes(value))
            feeds[spec.name] = np.ascontiguousarray(value)
        if len(batches) > 1:
            raise StageError(f"stage {self.entry.index}: inputs disagree on the batch size: {sorted(batches)}")
        return feeds
