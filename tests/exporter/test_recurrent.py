"""RNN, GRU and LSTM unrolled into standard operators compute what onnxruntime's own kernels compute."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgert.exporter.errors import ModelLoadError
from edgert.exporter.recurrent import unroll_recurrent
from tests.exporter.gradient_cases import run_ort as run

STEPS, BATCH, INPUT, HIDDEN = 5, 3, 4, 6
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def recurrent_model(op, directions=1, bias=True, initial=False, peepholes=False, layout=0, outputs=3, **attrs):
    rng = np.random.default_rng(3)
    gates = GATES[op]

    def param(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.4).astype(np.float32), name)

    inits = [param("W", directions, gates * HIDDEN, INPUT), param("R", directions, gates * HIDDEN, HIDDEN)]
    inputs = ["x", "W", "R", "B" if bias else "", "", "h0" if initial else ""]
    if bias:
        inits.append(param("B", directions, 2 * gates * HIDDEN))
    if initial:
        inits.append(param("h0", directions, BATCH, HIDDEN))
    if op == "LSTM":
        inputs.append("c0" if initial else "")
        if initial:
            inits.append(param("c0", directions, BATCH, HIDDEN))
        if peepholes:
            inputs.append("P")
            inits.append(param("P", directions, 3 * HIDDEN))
    count = {"RNN": 2, "GRU": 2, "LSTM": 3}[op] if outputs == 3 else outputs
    names = ["Y", "Y_h", "Y_c"][:count]
    if directions == 2:
        attrs["direction"] = "bidirectional"
    node = helper.make_node(op, inputs, names, name=f"/{op.lower()}", hidden_size=HIDDEN, layout=layout, **attrs)
    x_shape = [BATCH, STEPS, INPUT] if layout else [STEPS, BATCH, INPUT]
    graph = helper.make_graph([node], "rnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_empty_tensor_value_info(n) for n in names], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


CASES = {
    "rnn": recurrent_model("RNN"),
    "rnn_relu_bidirectional": recurrent_model("RNN", directions=2, activations=["Relu", "Tanh"]),
    "gru": recurrent_model("GRU"),
    "gru_linear_before_reset": recurrent_model("GRU", linear_before_reset=1, initial=True),
    "gru_reverse_no_bias": recurrent_model("GRU", bias=False, direction="reverse"),
    "gru_bidirectional_batch_first": recurrent_model("GRU", directions=2, layout=1, linear_before_reset=1),
    "gru_bidirectional": recurrent_model("GRU", directions=2, linear_before_reset=1),
    "lstm": recurrent_model("LSTM"),
    "lstm_initial_state_peepholes": recurrent_model("LSTM", initial=True, peepholes=True),
    "lstm_bidirectional_clip": recurrent_model("LSTM", directions=2, clip=0.5),
    "lstm_batch_first": recurrent_model("LSTM", layout=1),
}
# onnxruntime has no kernel for layout=1: those are compared with the layout=0 layer, transposed.
SEQUENCE_FIRST = {"gru_bidirectional_batch_first": "gru_bidirectional", "lstm_batch_first": "lstm"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unrolled_layer_computes_what_the_kernel_computes(case):
    model = CASES[case]
    unrolled = onnx.ModelProto()
    unrolled.CopyFrom(model)
    notes = unroll_recurrent(unrolled)
    assert len(notes) == 1 and f"over {STEPS} steps" in notes[0]
    assert not {n.op_type for n in unrolled.graph.node} & {"RNN", "GRU", "LSTM"}
    x_shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)}
    got = run(unrolled, feeds)
    if case in SEQUENCE_FIRST:
        reference = run(CASES[SEQUENCE_FIRST[case]], {"x": feeds["x"].transpose(1, 0, 2)})
        expected = {k: v.transpose(2, 0, 1, 3) if v.ndim == 4 else v.transpose(1, 0, 2) for k, v in reference.items()}
    else:
        expected = run(model, feeds)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{case}: {name}")


def test_a_sequence_of_unknown_length_is_refused_by_name():
    model = recurrent_model("LSTM")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    with pytest.raises(ModelLoadError, match=r"'/lstm' \(LSTM\): the sequence length must be fixed"):
        unroll_recurrent(model)


def test_packed_sequences_are_refused_by_name():
    model = recurrent_model("GRU")
    node = model.graph.node[0]
    node.input[4] = "lengths"
    model.graph.initializer.append(numpy_helper.from_array(np.full(BATCH, STEPS, np.int32), "lengths"))
    with pytest.raises(ModelLoadError, match="sequence_lens"):
        unroll_recurrent(model)
