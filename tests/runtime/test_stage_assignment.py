"""The stage assignment on the wire: one routine writes and reads it, strictly; its settings' defaults are
``edgert train``'s, as ``POST /profile``'s options' are ``edgert profile``'s."""

from __future__ import annotations

import dataclasses
import inspect

import click
import pytest

from edgert.coordinator.coordinator import TrainConfig
from edgert.errors import ProtocolError
from edgert.manifest import ArtifactFile, BoundaryTensor, ParameterInfo, StageEntry, TrainingConfig
from edgert.protocol import Peers, ProfileOptions, StageAssignment, read_request
from edgert.run_settings import RunSettings
from edgert.transport import BadRequest, Envelope
from edgert.transport.envelope import decode_envelope, encode_envelope

ROLES = ("backward", "eval", "infer", "parameters", "forward_stash", "backward_stash")
ENTRY = StageEntry(index=1, blocks=("fc1", "relu1"), inputs=(BoundaryTensor("x", "float32", ("N", 4)),),
                   outputs=(BoundaryTensor("h", "float32", ("N", 3)),),
                   parameters=(ParameterInfo("w", (4, 3), "float32"), ParameterInfo("n", (3,), "int64", False)),
                   artifacts=tuple(ArtifactFile(role, f"stage1/{role}.onnx", role[0] * 64, 7) for role in ROLES),
                   flops_per_sample=24, input_gradients={"x": "x_grad"}, output_gradients={"h": "h_grad"},
                   saved=("t0",))
ASSIGNMENT = StageAssignment(
    run_id="r1", entry=ENTRY, stages=3,
    peers=Peers("coap+tcp://10.0.0.1:5683", "coap+tcp://10.0.0.3:5683", "coap+tcp://10.0.0.9:5684", "w0", "w2"),
    settings=RunSettings(TrainingConfig(optimizer="sgd", momentum=0.9), forward_codec="int8:axis=1",
                         backward_threads=2, side_by_side=True, wait_timeout=30, memory_mode="stash",
                         replicate_every=5),
    replica_targets=("coap+tcp://10.0.0.3:5683",))


def wire(envelope: Envelope) -> Envelope:
    return decode_envelope(encode_envelope(envelope))


def test_an_assignment_survives_the_wire_as_nested_maps():
    files = {role: role.encode() for role in ASSIGNMENT.roles}
    envelope = wire(ASSIGNMENT.to_envelope(files))
    assert isinstance(envelope.meta["entry"], dict)  # not JSON text inside CBOR
    assert envelope.meta["settings"]["training"]["betas"] == [0.9, 0.999]
    assignment, received = StageAssignment.from_envelope(envelope)
    assert assignment == ASSIGNMENT and received == files
    assert assignment.settings.wait_timeout == 30.0 and isinstance(assignment.settings.wait_timeout, float)
    assert ASSIGNMENT.roles == ("backward", "eval", "infer", "parameters", "forward_stash", "backward_stash")


def test_absent_settings_take_the_one_default():
    meta = wire(ASSIGNMENT.to_envelope({})).meta
    meta["settings"] = {"training": meta["settings"]["training"]}
    assignment, _ = StageAssignment.from_envelope(Envelope(kind="stage", run_id="r1", stage=1, meta=meta))
    assert assignment.settings == RunSettings(ASSIGNMENT.settings.training)


def _broken(change) -> Envelope:
    envelope = wire(ASSIGNMENT.to_envelope({}))
    change(envelope.meta)
    return envelope


@pytest.mark.parametrize("change,message", [
    (lambda m: m.__setitem__("colour", "red"), "meta: unknown field 'colour'"),
    (lambda m: m["settings"].__setitem__("threads", 2), "meta.settings: unknown field 'threads'"),
    (lambda m: m["entry"]["artifacts"][0].__setitem__("mode", 1), r"meta.entry.artifacts\[0\]: unknown field 'mode'"),
    (lambda m: m["settings"].__setitem__("forward_threads", "2"),
     "meta.settings.forward_threads: expected an integer, got '2'"),
    (lambda m: m["settings"].__setitem__("backward_threads", 0), "meta.settings.backward_threads must be >= 1"),
    (lambda m: m["settings"].__setitem__("side_by_side", 1), "meta.settings.side_by_side: expected true or false"),
    (lambda m: m["settings"].__setitem__("wait_timeout", True), "meta.settings.wait_timeout: expected a number"),
    (lambda m: m["settings"].__setitem__("memory_mode", "swap"), "meta.settings.memory_mode must be one of"),
    (lambda m: m["settings"].__setitem__("backward_codec", "bogus"), "meta.settings.backward_codec must be a codec"),
    (lambda m: m["settings"]["training"].__setitem__("betas", [0.9]),
     "meta.settings.training.betas: expected a list of 2"),
    (lambda m: m["entry"].__setitem__("index", 1.0), "meta.entry.index: expected an integer"),
    (lambda m: m["entry"]["inputs"][0].__setitem__("shape", ["N", None]), r"meta.entry.inputs\[0\].shape\[1\]"),
    (lambda m: m["peers"].__setitem__("next", "http://x"), "meta.peers.next must be a worker URL"),
    (lambda m: m["peers"].__setitem__("next_codec", "int9"), "meta.peers.next_codec must be a codec spec"),
    (lambda m: m["peers"].__setitem__("previous_codec", "topk:ratio=2"),
     "meta.peers.previous_codec must be a codec spec"),
    (lambda m: m["peers"].__setitem__("previous_codec", 8), "meta.peers.previous_codec: expected"),
    (lambda m: m["replica_targets"].append(5), r"meta.replica_targets\[1\]: expected a string"),
    (lambda m: m.pop("settings"), "meta.settings: missing"),
    (lambda m: m.__setitem__("run_id", "r2"), "unknown field 'run_id'"),
])
def test_an_unknown_or_mistyped_field_is_refused_by_name(change, message):
    envelope = _broken(change)
    with pytest.raises(ProtocolError, match=message):
        StageAssignment.from_envelope(envelope)
    with pytest.raises(BadRequest, match=message):  # a 4.00 on the wire
        read_request(StageAssignment.from_envelope, envelope)


def test_a_stage_sends_in_its_links_codecs_else_in_the_runs():
    assert (ASSIGNMENT.forward_codec, ASSIGNMENT.backward_codec) == ("int8:axis=1", "none")
    linked = dataclasses.replace(ASSIGNMENT, peers=dataclasses.replace(ASSIGNMENT.peers, next_codec="none",
                                                                       previous_codec="topk:0.1"))
    assignment, _ = StageAssignment.from_envelope(wire(linked.to_envelope({})))
    assert (assignment.forward_codec, assignment.backward_codec) == ("none", "topk:0.1")


def test_the_signature_fields_and_the_profile_options_may_share_the_meta():
    envelope = wire(ASSIGNMENT.to_envelope({}))
    envelope.meta.update(signature=b"\x01", crl=b"pem", micro_batch=16)
    with pytest.raises(ProtocolError, match="unknown field 'micro_batch'"):
        StageAssignment.from_envelope(envelope)
    assert StageAssignment.from_envelope(envelope, beside=("micro_batch",))[0] == ASSIGNMENT


def option_defaults(command: str) -> dict:
    """``edgert <command>``'s options' defaults, by parameter name (a lone flag or a repeatable option states none;
    an on/off pair does)."""
    from edgert.cli import main

    return {param.name: param.default for param in main.get_command(click.Context(main), command).params
            if not (getattr(param, "is_flag", False) and not param.secondary_opts) and not param.multiple}


def test_edgert_train_defaults_are_the_settings_defaults(tmp_path):
    training = TrainingConfig()
    assert TrainConfig(tmp_path, ("coap+tcp://h:1",), tmp_path).run_settings(training) == RunSettings(training)
    options = option_defaults("train")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    field_of = {"codec": "forward_codec", "grad_codec": "backward_codec", "threads": "forward_threads"}
    fields = {option: field_of.get(option, option) for option in options
              if field_of.get(option, option) in defaults
              and option not in ("listen", "backward_threads")}  # they follow --insecure, --threads
    assert {"data", "epochs", "steps", "batch_size", "micro_batches", "schedule", "learning_rate", "seed", "codec",
            "grad_codec", "threads", "side_by_side", "memory_mode", "step_timeout", "replan", "replan_every",
            "replan_threshold", "replicate_every", "central_every", "replicas"} <= set(fields)
    assert {option: options[option] for option in fields} == {option: defaults[f] for option, f in fields.items()}


def test_edgert_profile_defaults_are_the_profile_options():
    from edgert.coordinator.profiling import profile_devices

    options = option_defaults("profile")
    signature = inspect.signature(profile_devices).parameters
    expected = {"micro_batch": ProfileOptions().micro_batch, "repeats": ProfileOptions().repeats,
                "memory_mode": RunSettings.memory_mode}
    assert {name: options[name] for name in expected} == expected
    assert {name: signature[name].default for name in expected} == expected
    assert ProfileOptions.from_envelope(Envelope(kind="control")) == ProfileOptions()  # a worker asked nothing
