"""The torch.distributed.pipelining peer of ``edgert bench pipeline`` trains the same shape as edgert's mlp-deep."""

import numpy as np
import pytest

from edgert.models import build_model, get_model_spec, load_dataset

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]
torch = pytest.importorskip("torch")


def test_the_peer_model_has_mlp_deeps_blocks_and_parameters():
    from onnx import numpy_helper

    from edgert.bench.torch_peer import _blocks

    blocks = _blocks(torch.nn)
    spec = get_model_spec("mlp-deep")
    assert len(blocks) == len(spec.blocks)
    model = build_model("mlp-deep")
    onnx_sizes = sorted(numpy_helper.to_array(t).size for t in model.graph.initializer)
    torch_sizes = sorted(p.numel() for block in blocks for p in block.parameters())
    assert torch_sizes == onnx_sizes


def test_the_peer_trains_in_four_processes():
    from edgert.bench.torch_peer import samples_per_s

    spec = get_model_spec("mlp-deep")
    data = load_dataset(spec.dataset, spec)
    rate = samples_per_s(data.x_train, data.y_train.astype(np.int64), [7, 6, 6, 7], micro_batches=8, batch_size=64,
                         steps=3, learning_rate=1e-3, warmup=1)
    assert np.isfinite(rate) and rate > 0
    with pytest.raises(ValueError, match="flat digits"):
        samples_per_s(data.x_train.reshape(-1, 8, 8), data.y_train, [26], 1, 8, 1, 1e-3)
