"""Admission of work: stage signatures, revocation lists, allowed graphs, bounded inboxes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cryptography.hazmat.primitives.serialization import Encoding
from onnx import TensorProto, helper

from edgert.security.admission import Admission, StageSigning
from edgert.security.errors import AdmissionRefused, GraphRefused
from edgert.security.keystore import Keystore
from edgert.security.onnx_scan import scan_model
from edgert.transport import Envelope
from edgert.transport.tls import Revocations
from edgert.worker.errors import InboxFull
from edgert.worker.inbox import Inbox


def _stage() -> Envelope:
    return Envelope(kind="stage", run_id="r1", stage=1, tensors={"training": np.arange(8, dtype=np.uint8)},
                    meta={"entry": {"index": 1, "artifacts": [{"sha256": "ab"}]}, "stages": 3,
                          "peers": {"previous": "a", "next": None},
                          "settings": {"training": {}, "wait_timeout": 120.0}})


def _admission(cluster) -> Admission:
    return Admission(cluster.store.certificate.public_bytes(Encoding.PEM), Revocations())


def test_a_signed_stage_is_admitted_and_any_change_is_refused(cluster):
    signing = StageSigning(cluster.store.sign, cluster.store.crl_pem)
    admission = _admission(cluster)
    admission.check_assignment(signing.apply(_stage()))
    assert len(admission.revocations) == 1  # the CRL it carried names the revoked device
    for change in (lambda e: e.meta["entry"]["artifacts"][0].__setitem__("sha256", "cd"),
                   lambda e: e.meta["settings"].__setitem__("wait_timeout", 1e9),
                   lambda e: e.meta["settings"].__setitem__("wait_timeout", 120),  # same value, another type
                   lambda e: e.meta["peers"].__setitem__("next", "coaps+tcp://evil:1")):
        tampered = signing.apply(_stage())
        change(tampered)
        with pytest.raises(AdmissionRefused, match="does not verify"):
            admission.check_assignment(tampered)
    signed = signing.apply(_stage())
    moved = Envelope(kind="stage", run_id="r1", stage=0, tensors=signed.tensors, meta=signed.meta)
    with pytest.raises(AdmissionRefused, match="does not verify"):
        admission.check_assignment(moved)
    with pytest.raises(AdmissionRefused, match="not signed"):
        admission.check_assignment(_stage())


def test_another_clusters_signature_and_crl_are_refused(cluster, tmp_path):
    other = Keystore.init(tmp_path / "other")
    admission = _admission(cluster)
    with pytest.raises(AdmissionRefused, match="does not verify"):
        admission.check_assignment(StageSigning(other.sign).apply(_stage()))
    with pytest.raises(AdmissionRefused, match="not signed by this cluster"):
        admission.take_crl(other.crl_pem)
    with pytest.raises(AdmissionRefused, match="not a PEM CRL"):
        admission.take_crl(b"garbage")


def test_an_older_revocation_list_does_not_undo_a_newer_one(tmp_path):
    store = Keystore.init(tmp_path / "keys")
    store.enroll("a")
    old = store.crl_pem
    (serial,) = store.revoke("a")
    admission = Admission(store.certificate.public_bytes(Encoding.PEM), Revocations())
    assert admission.take_crl(store.crl_pem) and serial in admission.revocations
    assert not admission.take_crl(old)
    assert serial in admission.revocations


def _model(domain: str = "", nested: bool = False, external: bool = False) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    inner = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], domain=domain)], "inner", [], [y])
    if nested:
        cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
        node = helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=inner)
        graph = helper.make_graph([node], "g", [cond, x], [y])
    else:
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], domain=domain)], "g", [x], [y])
    if external:
        weight = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
        weight.data_location = TensorProto.EXTERNAL
        entry = weight.external_data.add()
        entry.key, entry.value = "location", "/etc/passwd"
        graph.initializer.append(weight)
    return helper.make_model(graph).SerializeToString()


def test_graph_scan_allows_onnx_and_ort_domains_only():
    scan_model(_model()).check("plain")
    scan_model(_model("com.microsoft")).check("contrib")
    with pytest.raises(GraphRefused, match="'evil.ops' \\(op Relu\\)"):
        scan_model(_model("evil.ops")).check("stage 1 training")
    with pytest.raises(GraphRefused, match="'evil.ops'"):
        scan_model(_model("evil.ops", nested=True)).check("nested in an If")
    with pytest.raises(GraphRefused, match="external data"):
        scan_model(_model(external=True)).check("external")
    with pytest.raises(GraphRefused, match="not a valid ONNX model"):
        scan_model(b"\x3a\xff\xff\xff\xff\x0f").check("garbage")
    assert onnx.load_from_string(_model("com.microsoft")).graph.node[0].domain == "com.microsoft"


def test_inbox_refuses_more_tensor_bytes_than_its_budget():
    inbox = Inbox(capacity=100, max_bytes=1000)
    inbox.put(("act", 0, 0), {"x": np.zeros(200, np.float32)})
    with pytest.raises(InboxFull, match="tensor bytes"):
        inbox.put(("act", 0, 1), {"x": np.zeros(100, np.float32)})
    inbox.take(("act", 0, 0), timeout=1)
    inbox.put(("act", 0, 1), {"x": np.zeros(200, np.float32)})  # room again once taken
