"""Property tests against a live server: random bytes and well-formed-but-wrong envelopes.

The oracle: the server's answer equals what the local decoder says about the same
payload (2.04 if it decodes to an ``activations`` envelope, else the same error
code); never a 5.xx; and afterwards the server still answers valid requests.

Then a real ``edgert worker`` process, idle and training a stage, gets thousands of bad
requests on every resource, with every method and body kind (none, random bytes, other
CBOR, another Content-Format, an envelope of another kind, of another run, and the right
envelope with one field broken): every answer is a 4.xx naming the problem (never a 2.xx,
never a 5.xx), and the worker's run and state are untouched afterwards.
"""

import collections
import socket

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgert.coordinator.localcluster import LocalCluster
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import TrainingConfig, load_manifest, needed_roles
from edgert.models import build_model, save_model
from edgert.protocol import Health, Peers, Segment, StageAssignment
from edgert.run_settings import RunSettings
from edgert.transport import ClientConfig, Envelope, ResponseError, SyncClient, decode_envelope
from tests import fuzz_bodies
from tests.fuzz_bodies import BODY_KINDS, METHODS, broken, generic_body, misrouted, scalars

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow], derandomize=True)


@st.composite
def typed_arrays(draw):
    tag = draw(st.sampled_from([64, 65, 68, 69, 70, 71, 72, 76, 77, 78, 79, 80, 81, 84, 85, 86, 87, 100]))
    dims = draw(st.lists(st.integers(0, 4), max_size=3))
    itemsize = {0: 1, 1: 2, 2: 4, 3: 8}[(tag - 64) & 3] if 64 <= tag <= 87 else 1
    exact = int(np.prod(dims)) * itemsize
    length = draw(st.sampled_from([exact, exact, exact + 1, max(0, exact - 1), 3]))
    data = draw(st.binary(min_size=length, max_size=length))
    inner = cbor2.CBORTag(tag, data)
    shapes = [cbor2.CBORTag(40, [dims, inner]), inner, cbor2.CBORTag(40, [dims]),
              cbor2.CBORTag(40, [dims, list(data[:3])]), cbor2.CBORTag(41, [dims, inner])]
    return shapes[draw(st.integers(0, len(shapes) - 1))]  # (CBORTags are unhashable: no sampled_from)


@st.composite
def codec_maps(draw):
    entry = {"codec": draw(st.sampled_from(["fp16", "int8", "int4", "topk", "none", "zstd", 5])),
             "dtype": draw(st.sampled_from(["float32", "float16", "int8", "bogus"])),
             "shape": draw(st.lists(st.integers(0, 4), max_size=3) | scalars)}
    for key in draw(st.lists(st.sampled_from(["data", "q", "scale", "zero", "axis", "index", "value", "x"]),
                             max_size=4, unique=True)):
        entry[key] = draw(typed_arrays() | st.integers(-2, 5) | scalars)
    return entry


tensor_entries = typed_arrays() | codec_maps() | scalars


@st.composite
def wrong_envelopes(draw):
    """A valid envelope with one layer broken: the header, the tensors, the meta map, or several."""
    item = {"v": 1, "kind": "activations", "run_id": "r", "step": 1, "microbatch": 0, "stage": 0,
            "tensors": {"x": cbor2.CBORTag(40, [[2], cbor2.CBORTag(85, b"\x00" * 8)])}}
    focus = draw(st.sampled_from(["header", "tensors", "tensors", "tensors", "meta", "all"]))
    if focus in ("header", "all"):
        for key in draw(st.lists(st.sampled_from(sorted(item)), max_size=2, unique=True)):
            del item[key]
        for key in draw(st.lists(st.sampled_from(["v", "kind", "step", "stage", "extra", "tensors"]),
                                 max_size=2, unique=True)):
            item[key] = draw(scalars | st.lists(scalars, max_size=3)
                             | st.dictionaries(st.text(max_size=4), scalars, max_size=3))
        if draw(st.booleans()):
            item["kind"] = draw(st.sampled_from(["activations", "gradients", "Bad Kind", ""]))
    if focus in ("tensors", "all"):
        item["tensors"] = draw(st.dictionaries(st.text(max_size=6), tensor_entries, max_size=4))
    if focus in ("meta", "all"):
        item["meta"] = draw(st.dictionaries(st.text(max_size=4), scalars | typed_arrays()
                                            | st.lists(scalars, max_size=3), max_size=3))
    return cbor2.dumps(item)


def expected_code(payload: bytes, limits) -> str:
    """What the server must answer for this payload on /sink (kinds = activations)."""
    try:
        env = decode_envelope(payload, limits)
    except ResponseError as error:
        return error.code.dotted
    return "2.04" if env.kind == "activations" else "4.00"


def check(live, url, payload):
    response = live.client.post(url, "sink", payload, content_format=60, raise_for_status=False)
    expected = expected_code(payload, live.server.limits)
    assert response.code.dotted == expected, (response.code.dotted, response.text, payload[:80])
    assert not response.code.dotted.startswith("5")


@given(st.binary(max_size=300))
@settings(FUZZ, max_examples=250)
def test_random_bytes(live, payload):
    check(live, live.tcp, payload)


@given(wrong_envelopes())
@settings(FUZZ, max_examples=400)
def test_well_formed_but_wrong_envelopes(live, payload):
    check(live, live.tcp, payload)


@given(st.binary(max_size=200) | wrong_envelopes())
@settings(FUZZ, max_examples=60)
def test_udp_payloads(live, payload):
    check(live, live.udp, payload)


@given(st.binary(min_size=1, max_size=400))
@settings(FUZZ, max_examples=40)
def test_random_tcp_streams_after_csm(live, garbage):
    host, port = live.tcp.split("://")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(bytes.fromhex("40e123100000"))  # CSM (7.01) with Max-Message-Size 1 MiB
        sock.sendall(garbage)
        sock.settimeout(0.05)
        try:
            sock.recv(65536)
        except (TimeoutError, ConnectionError):
            pass


@given(st.binary(max_size=300))
@settings(FUZZ, max_examples=100)
def test_random_udp_datagrams(live, datagram):
    host, port = live.udp.split("://")[1].rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(datagram, (host, int(port)))


def test_server_still_serves_after_the_fuzzing(live, still_serving):
    still_serving()
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    live.client.send(live.tcp, "sink", Envelope("activations", step=9, tensors={"x": x}), codec="int8:axis=1")
    assert live.received[-1].step == 9 and np.abs(live.received[-1].tensors["x"] - x).max() < 0.05


# -- a real worker -----------------------------------------------------------------------------------------

RUN_ID, NOWHERE = "fuzz", "coap+tcp://127.0.0.1:9"
SEGMENT_STEPS, BATCH, MICRO = 1000, 8, 2  # the loaded worker waits for step 0's activations all along
WORKER_ROUTES = {".well-known/core": ("GET",), "health": ("GET",), "stage": ("PUT",), "run": ("POST",),
                 "batch": ("POST",), "stop": ("POST",), "weights": ("GET", "PUT", "FETCH"), "migrate": ("POST",),
                 "replica": ("GET", "PUT"), "profile": ("POST",), "probe": ("POST",), "echo": ("POST",),
                 "act": ("POST",), "grad": ("POST",), "groupgrad": ("POST",)}
KIND_OF = {"stage": "stage", "run": "control", "batch": "batch", "weights": "weights", "migrate": "control",
           "replica": "weights", "profile": "stage", "probe": "control", "act": "activations",
           "grad": "gradients", "groupgrad": "group_gradients"}
WRONG_GROUP = {"group": [5, "x", [], {"members": []}, {"members": [NOWHERE], "shares": [1.0, 2.0]},
                         {"members": [NOWHERE, NOWHERE], "shares": [1.0, 1.0]}],
               "member": [-1, 1, 7, True, "x", None]}  # the stage is held by one worker
answers: collections.Counter = collections.Counter()  # (worker state, path, method, code) -> count


class FuzzedWorker:
    """Two worker processes on loopback: one idle, one training stage 1 of 3 (waiting for activations)."""

    def __init__(self, tmp) -> None:
        save_model(build_model("mlp"), tmp / "mlp.onnx")
        export_plan(tmp / "mlp.onnx", tmp / "plan", ExportOptions(stages=3, training=TrainingConfig()))
        manifest = load_manifest(tmp / "plan")
        self.entry = manifest.stages[1]
        self.assignment = StageAssignment(
            run_id=RUN_ID, entry=self.entry, stages=3, peers=Peers(NOWHERE, NOWHERE, NOWHERE),
            settings=RunSettings(manifest.training, wait_timeout=3600.0, replicate_every=5, central_every=0),
            replica_targets=(NOWHERE,))
        self.files = {a.role: (tmp / "plan" / a.path).read_bytes() for a in self.entry.artifacts}
        self.cluster = LocalCluster(2, names=["idle", "loaded"])
        self.cluster.start()
        self.client = SyncClient.start(ClientConfig(timeout=20.0, retries=0))
        self.idle, self.loaded = self.cluster.urls
        self.client.request("PUT", self.loaded, "stage", self.assignment.to_envelope(self.files))
        self.segment = Segment("gpipe", 3, 0, SEGMENT_STEPS, BATCH, MICRO)
        self.client.send(self.loaded, "run", self.segment.to_envelope(RUN_ID))
        self.weights = self.client.get(self.loaded, "weights").payload

    def close(self) -> None:
        self.client.close()
        self.cluster.stop()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    fuzzed = FuzzedWorker(tmp_path_factory.mktemp("fuzz-worker"))
    yield fuzzed
    fuzzed.close()


def envelope_bytes(kind, run_id=RUN_ID, **fields) -> bytes:
    return fuzz_bodies.envelope_bytes(kind, run_id, **fields)


@st.composite
def right_kind_wrong_content(draw, worker, path):
    """The resource's own envelope kind, of this run, with exactly one thing wrong."""
    entry = worker.entry
    if path in ("stage", "profile"):
        envelope = worker.assignment.to_envelope(worker.files)
        meta, tensors = dict(envelope.meta), dict(envelope.tensors)
        how = draw(st.sampled_from(["meta", "settings", "settings", "file", "missing file", "stage"]))
        stage = entry.index
        if how == "meta":
            meta = broken(draw, meta, optional=("replica_targets", "group", "member"), wrong=WRONG_GROUP)
        elif how == "settings":  # each has a default but the training config
            told = meta["settings"]
            meta["settings"] = broken(draw, told, optional=tuple(k for k in told if k != "training"))
            if draw(st.integers(0, 3)) == 0:
                meta["settings"]["forward_codec"] = draw(st.sampled_from(["bogus", "topk:ratio=2", "int8:axis=x"]))
        elif how == "file":
            role = draw(st.sampled_from(needed_roles(entry)))
            data = bytearray(tensors[role].tobytes())
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
            tensors[role] = np.frombuffer(bytes(data), np.uint8)
        elif how == "missing file":
            del tensors[draw(st.sampled_from(needed_roles(entry)))]
        else:
            stage = draw(st.sampled_from([0, 2, 7]))
        if path == "profile" and draw(st.booleans()):
            meta[draw(st.sampled_from(["micro_batch", "repeats"]))] = draw(st.sampled_from([0, -3, 10**6, "16", 1.5]))
        return envelope_bytes(KIND_OF[path], stage=stage, meta=meta, tensors=tensors)
    if path == "run":
        valid = {"command": "run", "schedule": "gpipe", "stages": 3, "first_step": 0, "steps": 4, "batch_size": 8,
                 "micro_batches": 2, "checkpoint_steps": [1]}
        meta = draw(st.sampled_from([
            "segment", "segment", "truncate", "stages", "micro", "checkpoint"]))
        if meta == "segment":
            meta = broken(draw, {k: v for k, v in valid.items() if k != "command"}, optional=("checkpoint_steps",))
        elif meta == "truncate":
            meta = {"command": "truncate", **({} if draw(st.booleans()) else
                                              {"last_step": draw(st.sampled_from([-1, "3", 1.5, None, [2]]))})}
        elif meta == "stages":
            meta = {**valid, "stages": draw(st.sampled_from([1, 2, 4]))}
        elif meta == "micro":
            meta = {**valid, "micro_batches": 9}
        else:
            meta = {**valid, "checkpoint_steps": [draw(st.sampled_from([-1, 4, 99]))]}
        return envelope_bytes("control", meta=meta)
    if path in ("act", "grad", "batch"):
        spec = (entry.inputs if path == "act" else
                [t for t in entry.outputs if t.name in entry.output_gradients] if path == "grad" else entry.inputs)[0]
        size = BATCH // MICRO if path != "batch" else BATCH
        shape = [size if d == "N" else int(d) for d in spec.shape]
        name, dtype, step, micro = spec.name, np.float32, 0, 0
        stage = entry.index
        how = draw(st.sampled_from(["name", "dtype", "shape", "batch", "step", "microbatch", "stage"]))
        if how == "name":
            name = draw(st.sampled_from(["x", name + "_", "input"]))
        elif how == "dtype":
            dtype = np.float64
        elif how == "shape":
            shape[-1] += draw(st.integers(1, 3))
        elif how == "batch":
            shape[0] = draw(st.sampled_from([1, 3, 8, 5]))
        elif how == "step":
            step = draw(st.integers(SEGMENT_STEPS, 2**40))
        elif how == "microbatch":
            micro = draw(st.integers(MICRO, 50))
        else:
            stage = draw(st.sampled_from([0, 2, 9]))
        tensors = {name: np.zeros(shape, dtype)}
        if path == "batch" or draw(st.integers(0, 9)) == 0:
            tensors["extra"] = np.zeros(shape, np.float32)
        return envelope_bytes(KIND_OF[path], step=step, microbatch=micro, stage=stage, tensors=tensors)
    if path == "groupgrad":  # the loaded stage is held by one worker: no member of a group may send it gradients
        member = draw(st.sampled_from([0, 1, -1, "x", None]))
        return envelope_bytes("group_gradients", stage=draw(st.sampled_from([entry.index, 0, 5])),
                              meta={"member": member}, tensors={"gradient": np.zeros(draw(st.integers(1, 9)),
                                                                                     np.float32)})
    if path == "weights":  # PUT while the stage runs (4.09), or state that does not fit it
        parameter = entry.parameters[0]
        value = np.zeros(parameter.shape, np.float32)
        tensors = draw(st.sampled_from([{parameter.name: value}, {"nope": value}, {parameter.name: value[:1]},
                                        {parameter.name + "#exp_avg": value}]))
        return envelope_bytes("weights", tensors=tensors)
    if path == "fetch-weights":
        names = [p.name for p in entry.parameters]
        meta = broken(draw, {"names": names, "copy_step": 3, "previous": True}, optional=("copy_step", "previous"))
        if "names" in meta and meta["names"] == names:
            meta["names"] = names + ["zz-unknown"]
        return envelope_bytes("control", meta=meta)
    if path == "migrate":
        source = {"url": NOWHERE, "names": [p.name for p in entry.parameters], "previous": True, "copy_step": 3}
        meta = draw(st.sampled_from(["no sources", "not a list", "not a map", "source"]))
        meta = ({} if meta == "no sources" else {"sources": {"url": NOWHERE}} if meta == "not a list"
                else {"sources": [draw(st.sampled_from(fuzz_bodies.WRONG_VALUES[dict]))]} if meta == "not a map"
                else {"sources": [broken(draw, source, optional=("previous", "copy_step"))]})
        return envelope_bytes("control", meta=meta)
    if path == "replica":  # stage 1 keeps copies of stage 0 only, after steps of its segment only
        parameter = entry.parameters[0]
        stage, step = draw(st.sampled_from([(1, 3), (2, 3), (100, 3), (0, SEGMENT_STEPS + 5)]))
        return envelope_bytes("weights", stage=stage, step=step,
                              tensors={parameter.name: np.zeros(parameter.shape, np.float32)},
                              meta={"origin": "evil"})
    # probe
    return envelope_bytes("control", meta=draw(st.sampled_from(
        [{}, {"target": 5}, {"target": "http://x:1"}, {"target": "coap+tcp://"}, {"target": ["a"]}])))


@st.composite
def bad_requests(draw, worker):
    """(which worker, path, method, payload, Content-Format): every one of them wrong for a reason."""
    which = draw(st.sampled_from(["idle", "loaded", "loaded", "loaded"]))
    path = draw(st.sampled_from(sorted(WORKER_ROUTES)))
    allowed = WORKER_ROUTES[path]
    if path in (".well-known/core", "echo"):  # they take any payload: only another method is wrong
        return which, path, draw(st.sampled_from([m for m in METHODS if m not in allowed])), \
            draw(st.binary(max_size=40)), None
    method, payload, content_format = misrouted(draw, allowed)
    if payload is not None:
        return which, path, method, payload, content_format
    if path == "stop":
        body = draw(st.sampled_from(["utf8", "control", "long", "format"]))
        if body == "utf8":
            return which, path, method, b"\xff" + draw(st.binary(max_size=30)), None
        if body == "control":
            return which, path, method, draw(st.text(max_size=10)).encode() + b"\x00\x1b", None
        if body == "long":
            return which, path, method, b"a" * draw(st.integers(1025, 3000)), None
        return which, path, method, envelope_bytes("control"), 60
    kind = draw(st.sampled_from(BODY_KINDS))
    if kind == "run" and path not in ("run", "batch", "migrate", "replica", "act", "grad"):
        kind = "content"
    if kind != "content":
        own = "control" if (path, method) == ("weights", "FETCH") else KIND_OF[path]
        return (which, path, method, *generic_body(draw, kind, own, RUN_ID))
    target = "fetch-weights" if (path, method) == ("weights", "FETCH") else path
    return which, path, method, draw(right_kind_wrong_content(worker, target)), None


@given(st.data())
@settings(FUZZ, max_examples=2100)
def test_a_worker_answers_every_bad_request_with_a_4xx(worker, data):
    which, path, method, payload, content_format = data.draw(bad_requests(worker))
    url = worker.idle if which == "idle" else worker.loaded
    response = worker.client.request(method, url, path, payload, content_format=content_format,
                                     raise_for_status=False)
    code = response.code.dotted
    answers[(which, path, method, code[0])] += 1
    assert code.startswith("4.") and response.text, (which, path, method, code, response.text, payload[:120])


def test_the_fuzzed_worker_is_untouched_and_every_route_was_tried(worker):
    total = sum(answers.values())
    assert total >= 2000, total
    assert not [k for k in answers if k[3] != "4"]
    tried = {(path, method) for _, path, method, _ in answers}
    every = {(path, method) for path in WORKER_ROUTES for method in METHODS}
    assert every - tried == {(".well-known/core", "GET"), ("echo", "POST")}  # they take any payload
    health = Health.from_envelope(decode_envelope(worker.client.get(worker.loaded, "health").payload))
    assert (health.state, health.run_id, health.stage, health.step) == ("running", RUN_ID, 1, -1), health
    assert worker.client.get(worker.loaded, "weights").payload == worker.weights
    assert Health.from_envelope(decode_envelope(worker.client.get(worker.idle, "health").payload)).state == "idle"
