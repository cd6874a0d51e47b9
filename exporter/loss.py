"""Loss sub-graphs appended to stages: the real loss on the last, a VJP loss on the others.

Last stage: ``loss = L(prediction, labels)`` and ``scaled_loss = loss * loss_scale``, where
the runtime feeds ``loss_scale = micro-batch size / batch size`` so that gradients summed
over micro-batches equal the gradient of the whole batch's mean loss.
Other stages take the next stage's gradients as inputs ``grad_<out>``, where their backward starts;
a gradient builder that needs a scalar loss (the training build's, a reference) gets
``loss = sum_k ReduceSum(out_k * grad_out_k)``, whose parameter gradients are exactly the
vector-Jacobian product with those gradients.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from edgert.exporter.errors import ExportError
from edgert.exporter.slice import value_info_of as _value_info
from edgert.manifest import BoundaryTensor
from edgert.scoring import LOSSES

LOSS_OUTPUT = "loss"
SCALED_LOSS_OUTPUT = "scaled_loss"
LOSS_SCALE_INPUT = "loss_scale"
LABELS_INPUT = "labels"
LOSS_SEED = "scaled_loss_grad"  # the last stage's backward starts from this 1 (d scaled_loss / d scaled_loss)


def gradient_input_name(output: str) -> str:
    """Name of the training-graph input that carries d(loss)/d(output) from the next stage."""
    return f"grad_{output}"


def labels_for(loss: str, prediction: BoundaryTensor) -> BoundaryTensor:
    """The labels tensor a loss needs for a given prediction."""
    if loss == "cross_entropy":
        if len(prediction.shape) < 2:
            raise ExportError(f"cross_entropy needs a prediction of rank >= 2 (classes last); "
                              f"{prediction.name!r} has shape {list(prediction.shape)}")
        return BoundaryTensor(LABELS_INPUT, "int64", prediction.shape[:-1])
    if loss == "mse":
        return BoundaryTensor(LABELS_INPUT, prediction.dtype, prediction.shape)
    raise ExportError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")


def add_real_loss(model: onnx.ModelProto, loss: str, prediction: BoundaryTensor) -> BoundaryTensor:
    """Append ``loss`` and ``scaled_loss`` to the last stage; return its labels tensor."""
    labels = labels_for(loss, prediction)
    graph = model.graph
    graph.input.append(_value_info(labels))
    graph.input.append(helper.make_tensor_value_info(LOSS_SCALE_INPUT, TensorProto.FLOAT, []))
    if loss == "cross_entropy":
        scores = prediction.name
        rank = len(prediction.shape)
        if rank > 2:  # SoftmaxCrossEntropyLoss wants classes on axis 1
            scores = "loss/scores_classes_first"
            graph.node.append(helper.make_node("Transpose", [prediction.name], [scores], name="/loss/Transpose",
                                               perm=[0, rank - 1, *range(1, rank - 1)]))
        graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [scores, labels.name],
                                           [LOSS_OUTPUT, "loss/log_prob"], name="/loss/SoftmaxCrossEntropyLoss",
                                           reduction="mean"))
    else:
        graph.node.extend([
            helper.make_node("Sub", [prediction.name, labels.name], ["loss/diff"], name="/loss/Sub"),
            helper.make_node("Mul", ["loss/diff", "loss/diff"], ["loss/square"], name="/loss/Mul"),
            helper.make_node("ReduceMean", ["loss/square"], [LOSS_OUTPUT], name="/loss/ReduceMean", keepdims=0),
        ])
    graph.node.append(helper.make_node("Mul", [LOSS_OUTPUT, LOSS_SCALE_INPUT], [SCALED_LOSS_OUTPUT],
                                       name="/loss/Scale"))
    return labels


def add_gradient_inputs(model: onnx.ModelProto, outputs: list[BoundaryTensor], with_loss: bool = False
                        ) -> dict[str, str]:
    """Add an input ``grad_<out>`` per output in ``outputs`` (and with ``with_loss`` the VJP loss over them);
    return output name -> gradient input name."""
    if not outputs:
        raise ExportError(f"{model.graph.name}: no output of this stage receives a gradient from the next stage")
    graph = model.graph
    gradients = {}
    for output in outputs:
        grad = gradient_input_name(output.name)
        gradients[output.name] = grad
        graph.input.append(_value_info(BoundaryTensor(grad, output.dtype, output.shape)))
    if with_loss:
        _add_vjp_loss(graph, gradients)
    return gradients


def _add_vjp_loss(graph: onnx.GraphProto, gradients: dict[str, str]) -> None:
    terms = []
    for k, (output, grad) in enumerate(gradients.items()):
        graph.node.append(helper.make_node("Mul", [output, grad], [f"vjp/product_{k}"], name=f"/vjp/Mul_{k}"))
        graph.node.append(helper.make_node("ReduceSum", [f"vjp/product_{k}"], [f"vjp/term_{k}"],
                                           name=f"/vjp/ReduceSum_{k}", keepdims=0))
        terms.append(f"vjp/term_{k}")
    # ORT has no gradient for Sum: add the terms pairwise.
    total = terms[0]
    for k, term in enumerate(terms[1:], start=1):
        name = SCALED_LOSS_OUTPUT if k == len(terms) - 1 else f"vjp/partial_{k}"
        graph.node.append(helper.make_node("Add", [total, term], [name], name=f"/vjp/Add_{k}"))
        total = name
    if len(terms) == 1:
        graph.node.append(helper.make_node("Identity", [total], [SCALED_LOSS_OUTPUT], name="/vjp/Identity"))
