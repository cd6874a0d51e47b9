"""Stage executors wired together in one process: schedules compute what the chain computes."""

import threading
import time

import numpy as np
import pytest

from edgert.chain import StageChain
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.source import from_model_proto
from edgert.manifest import TrainingConfig, load_manifest
from edgert.models import build_model
from edgert.schedule import MicroBatch, Window, split_batch
from edgert.stage import StageSession
from edgert.worker.errors import InboxTimeout
from edgert.worker.executor import StageExecutor
from edgert.worker.inbox import Inbox


def make_plan(tmp_path, name="cnn", stages=3, lr=1e-2):
    source = from_model_proto(build_model(name), f"{name}.onnx")
    training = TrainingConfig(learning_rate=lr)
    options = ExportOptions(stages=stages, training=training)
    analysis = prepare_analysis(source, options)
    write_plan(source, analysis, choose_cuts(analysis, options), tmp_path / "plan", training)
    return tmp_path / "plan"


class ThreadedPipeline:
    """Executors on threads; sends go straight into the neighbour's inbox."""

    def __init__(self, plan, side_by_side=False, memory_mode="recompute"):
        manifest = load_manifest(plan)
        self.inboxes = [Inbox() for _ in manifest.stages]
        self.executors = []
        for k, entry in enumerate(manifest.stages):
            session = StageSession(entry, plan, manifest.training, memory_mode=memory_mode)
            self.executors.append(StageExecutor(session, k, self.inboxes[k], self._sender("act", k + 1),
                                                self._sender("grad", k - 1), wait_timeout=30,
                                                side_by_side=side_by_side))

    def _sender(self, kind, target):
        def send(key, tensors):
            self.inboxes[target].put((kind, *key), tensors)
        return send

    def run(self, window, inputs, labels):
        for m in window.microbatches:
            self.inboxes[0].put(("act", m.step, m.index), inputs[m.key])
            self.inboxes[-1].put(("labels", m.step, m.index), labels[m.key])
        results, errors = {}, []

        def work(k):
            try:
                results[k] = self.executors[k].run_window(window)
            except Exception as error:  # surfaced below
                errors.append(error)
                for inbox in self.inboxes:
                    inbox.abort(str(error))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(self.executors))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        return results

    def parameters(self):
        return {k: v for e in self.executors for k, v in e.session.parameters().items()}


def batches(seed, count, batch, shape=(1, 8, 8)):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, *shape)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int64))
            for _ in range(count)]


def assert_trains_as_the_chain(pipeline, chain, schedule, data, micro_batches):
    """Train ``pipeline`` and the single-process ``chain`` on ``data``, batch by batch: each step's loss, then the
    parameters, agree."""
    stages = len(pipeline.executors)
    for step, (x, y) in enumerate(data):
        micro = split_batch(step, len(x), micro_batches)
        inputs = {m.key: {"input": x[sum(b.size for b in micro[:m.index]):][:m.size]} for m in micro}
        labels = {m.key: {"labels": y[sum(b.size for b in micro[:m.index]):][:m.size]} for m in micro}
        reports = pipeline.run(Window(schedule, stages, tuple(micro)), inputs, labels)
        chain_loss = chain.train_batch({"input": x}, {"labels": y}, micro_batches=micro_batches).loss
        chain.step()
        last = reports[stages - 1][0]
        assert last.samples == len(x)
        assert last.loss_sum / last.samples == pytest.approx(chain_loss, rel=1e-5)
    expected = chain.parameters()
    for name, value in pipeline.parameters().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synchronous_schedules_equal_the_chain(tmp_path, schedule):
    plan = make_plan(tmp_path)
    assert_trains_as_the_chain(ThreadedPipeline(plan), StageChain(plan), schedule, batches(0, 5, 12), 4)


@pytest.mark.parametrize("schedule,memory_mode", [("gpipe", "recompute"), ("1f1b", "recompute"), ("1f1b", "stash")])
def test_forwards_side_by_side_with_the_backwards_equal_the_chain(tmp_path, schedule, memory_mode):
    plan = make_plan(tmp_path, "mlp", stages=3)
    pipeline = ThreadedPipeline(plan, side_by_side=True, memory_mode=memory_mode)
    assert [e._lane is not None for e in pipeline.executors] == [True, True, False]  # the last has no forward
    assert_trains_as_the_chain(pipeline, StageChain(plan), schedule, batches(1, 4, 16, shape=(64,)), 8)


def test_a_stage_whose_forward_updates_running_statistics_keeps_one_thread(tmp_path):
    pipeline = ThreadedPipeline(make_plan(tmp_path, "cnn"), side_by_side=True)
    assert all(executor._lane is None for executor in pipeline.executors)


def test_a_failure_in_the_forward_lane_is_raised_in_the_executors_thread_which_goes_on_after(tmp_path):
    plan = make_plan(tmp_path, "mlp", stages=2)
    manifest = load_manifest(plan)
    session = StageSession(manifest.stages[0], plan, manifest.training)
    inbox, broken, sent = Inbox(), [True], []

    def send_forward(key, tensors):
        if broken[0]:
            raise ConnectionError("the next stage is unreachable")
        sent.append(key)

    executor = StageExecutor(session, 0, inbox, send_forward, lambda key, tensors: None, wait_timeout=30,
                             side_by_side=True)
    x = np.ones((8, 64), np.float32)

    def window(step):
        micro = split_batch(step, 8, 2)
        for m in micro:
            inbox.put(("act", step, m.index), {"input": x[:m.size]})
        return Window("1f1b", 2, tuple(micro))

    # the backward waits for gradients that never come: the lane's failure wakes it, well before the timeout
    with pytest.raises(ConnectionError, match="the next stage is unreachable"):
        executor.run_window(window(0))
    executor.reset()
    broken[0] = False
    second = window(1)
    for m in second.microbatches:
        inbox.put(("grad", 1, m.index), {"/fc1/Relu_output_0": np.ones((m.size, 128), np.float32)})
    reports = executor.run_window(second)
    assert [r.step for r in reports] == [1] and sent == [(1, 0), (1, 1)]


def test_async_schedule_trains_and_keeps_staleness_bounded(tmp_path):
    from edgert.models import load_dataset

    plan = make_plan(tmp_path, lr=3e-3)
    pipeline = ThreadedPipeline(plan)
    digits = load_dataset("digits-image")
    data = [(digits.x_train[i * 16:(i + 1) * 16], digits.y_train[i * 16:(i + 1) * 16]) for i in range(24)]
    micro = tuple(MicroBatch(step, 0, 16, 1.0) for step in range(len(data)))
    inputs = {m.key: {"input": data[m.step][0]} for m in micro}
    labels = {m.key: {"labels": data[m.step][1]} for m in micro}
    first = pipeline.run(Window("async", 3, micro), inputs, labels)
    assert [r.step for r in first[0]] == list(range(24))  # one optimizer step per micro-batch
    assert all(e._stash == {} and e._held == {} for e in pipeline.executors)  # nothing leaks
    # the same 24 batches again: the async pipeline learned them
    micro2 = tuple(MicroBatch(24 + m.step, 0, 16, 1.0) for m in micro)
    inputs2 = {m.key: {"input": data[m.step - 24][0]} for m in micro2}
    labels2 = {m.key: {"labels": data[m.step - 24][1]} for m in micro2}
    second = pipeline.run(Window("async", 3, micro2), inputs2, labels2)
    def loss(reports):
        return sum(r.loss_sum for r in reports) / sum(r.samples for r in reports)

    assert loss(second[2]) < 0.8 * loss(first[2])


def test_split_batch_sizes_and_scales():
    micro = split_batch(7, 10, 4)
    assert [m.size for m in micro] == [2, 3, 2, 3]
    assert sum(m.loss_scale for m in micro) == pytest.approx(1.0)
    assert [m.key for m in micro] == [(7, 0), (7, 1), (7, 2), (7, 3)]
    assert len(split_batch(0, 3, 8)) == 3  # never an empty micro-batch


def test_stashed_weights_give_the_gradients_of_the_weights_the_forward_used(tmp_path):
    """Weight stashing (async): a backward inside ``stashed_weights`` sees the snapshot, not the live weights."""
    plan = make_plan(tmp_path)
    manifest = load_manifest(plan)
    entry = manifest.stages[1]
    stashing, reference = (StageSession(entry, plan, manifest.training) for _ in range(2))
    rng = np.random.default_rng(3)
    inputs = {t.name: rng.standard_normal(t.shape_for(6)).astype(np.float32) for t in entry.inputs}
    output_gradients = {t.name: rng.standard_normal(t.shape_for(6)).astype(np.float32) for t in entry.outputs}
    snapshot = stashing.weights_snapshot()
    moved = {n: v + 0.05 for n, v in stashing.parameters(include_buffers=False).items()}
    stashing.load_parameters(moved)  # the optimizer stepped after this micro-batch's forward
    with stashing.stashed_weights(snapshot):
        stashed = stashing.backward(inputs, output_gradients=output_gradients)
    expected = reference.backward(inputs, output_gradients=output_gradients)
    for name, value in reference.gradients().items():
        np.testing.assert_allclose(stashing.gradients()[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    for name, value in expected.input_gradients.items():
        np.testing.assert_allclose(stashed.input_gradients[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    for name, value in stashing.parameters(include_buffers=False).items():
        np.testing.assert_array_equal(value, moved[name])  # the live weights are back
    live = StageSession(entry, plan, manifest.training)
    live.load_parameters(moved)
    live.backward(inputs, output_gradients=output_gradients)
    name = next(iter(moved))
    assert not np.allclose(live.gradients()[name], reference.gradients()[name], atol=1e-6)  # the test can fail


def test_an_emulated_slowdown_times_a_group_members_calls_by_its_own_rows(tmp_path):
    """A member owning 2 rows of every 8-row micro-batch (the first of two stages) warms up on 2 rows and is
    slowed against those warm times: every call it times is keyed by its 2 rows, never by the micro-batch's 8
    (which no warm-up measured)."""
    from edgert.groups import StageGroup, StageRouting
    from edgert.protocol import ACT, GRAD, GROUP_GRAD
    from edgert.schedule import Computation
    from edgert.worker.group_exchange import GRADIENT
    from edgert.worker.slowdown import SlowdownSchedule

    plan = make_plan(tmp_path, name="mlp", stages=2)
    manifest = load_manifest(plan)
    entry = manifest.stages[0]
    session = StageSession(entry, plan, manifest.training)
    inbox, sent = Inbox(), []
    group = StageGroup(("a", "b"), (0.75, 0.25))
    routing = StageRouting(group, 1, None, StageGroup(("c",), (1.0,)))
    def ignore(*_, **__):
        return None

    executor = StageExecutor(session, 0, inbox, ignore, ignore, SlowdownSchedule.parse("2"), wait_timeout=30,
                             routing=routing, send_group=lambda *args: sent.append(args))
    micro = split_batch(0, 16, 2)
    first_row = group.ranges(8)[1][0]
    rng = np.random.default_rng(0)
    (spec,), (out,) = entry.inputs, entry.outputs
    for m in micro:
        inbox.put((ACT, 0, m.index), {spec.name: rng.standard_normal(spec.shape_for(2)).astype(np.float32)})
        inbox.put((GRAD, 0, m.index, first_row), {out.name: rng.standard_normal(out.shape_for(2)).astype(np.float32)})
    inbox.put((GROUP_GRAD, 0, 0), {GRADIENT: np.zeros_like(session.gradient_flat())})
    (report,) = executor.run_window(Window("gpipe", 2, tuple(micro)))
    assert len(sent) == 1
    timed = set(executor.slowdown._warm)
    assert {(Computation.FORWARD, 2), (Computation.BACKWARD, 2)} <= timed
    assert not [call for call in timed if isinstance(call, tuple) and call[1] == 8], timed


def test_abandoning_a_window_wakes_a_forward_waiting_for_its_input_and_the_next_window_runs(tmp_path):
    plan = make_plan(tmp_path, "mlp", stages=2)
    manifest = load_manifest(plan)
    session = StageSession(manifest.stages[0], plan, manifest.training)
    inbox, sent = Inbox(), []
    executor = StageExecutor(session, 0, inbox, lambda key, tensors: sent.append(key), lambda key, tensors: None,
                             wait_timeout=30, side_by_side=True)
    x, grad = np.ones((4, 64), np.float32), "/fc1/Relu_output_0"
    first = Window("1f1b", 2, tuple(split_batch(0, 8, 2)))
    inbox.put(("act", 0, 0), {"input": x})  # micro-batch 1's input never comes: its forward waits in the lane
    inbox.put(("grad", 0, 0), {grad: np.ones((4, 7), np.float32)})  # and micro-batch 0's gradient is malformed
    with pytest.raises(Exception, match="grad"):
        executor.run_window(first)
    executor.reset()  # wakes the waiting forward, and leaves nothing behind that fails the next window
    time.sleep(0.2)
    with pytest.raises(InboxTimeout):  # a wait waits again (not interrupted by the abandoned window)
        inbox.take(("act", 9, 0), timeout=0.05)
    second = Window("1f1b", 2, tuple(split_batch(1, 8, 2)))
    for m in second.microbatches:
        inbox.put(("act", 1, m.index), {"input": x})
        inbox.put(("grad", 1, m.index), {grad: np.ones((4, 128), np.float32)})
    assert [r.step for r in executor.run_window(second)] == [1] and sent[-2:] == [(1, 0), (1, 1)]
