"""The models of the torch coverage matrix (issue 29, item 3), built with random weights, and the two ways of
exporting them that torch offers.

Every model is built from its library's constructor with random weights and nothing downloaded
(torchvision ``weights=None``, timm ``pretrained=False``, transformers from a small config), with
10 classes, every dropout and stochastic-depth probability at 0 (edgert removes Dropout, and a sampled
mask could not be compared with torch anyway), and every parameter or buffer that starts constant
(biases at 0, BatchNorm's scale at 1 and running statistics) given seeded random values, so that each
tensor is told apart by its values and a folded BatchNorm is not the identity.
Images are 64x64 for BatchNorm CNNs (BatchNorm over the last maps of a 32x32 input is ill-conditioned)
and 32x32 for the transformers; token models read 16 tokens of a 100-word vocabulary.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CLASSES = 10
VOCABULARY = 100
TOKENS = 16
EXPORTERS = ("torchscript", "dynamo")  # dynamo=False (opset 17), and torch's default dynamo=True
MODES = ("training", "eval")


@dataclass(frozen=True)
class ZooModel:
    """One model of the matrix: how to build it and what it reads."""

    name: str
    build: Callable[[], nn.Module]
    input_name: str  # "images" or "tokens"
    shape: tuple[int, ...]  # one sample's shape

    def batch(self, size: int, seed: int) -> torch.Tensor:
        """A seeded batch of ``size`` samples (token ids 1.. so that no token is GPT-2's padding id 0)."""
        generator = torch.Generator().manual_seed(seed)
        if self.input_name == "tokens":
            return torch.randint(1, VOCABULARY, (size, *self.shape), generator=generator)
        return torch.randn((size, *self.shape), generator=generator)

    def module(self, seed: int = 0) -> nn.Module:
        """The model with its seeded random weights, in training mode."""
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = self.build()
        distinguish_constant_tensors(module, seed)
        return module.train()


def distinguish_constant_tensors(module: nn.Module, seed: int) -> None:
    """Give each floating parameter or buffer whose elements are all equal seeded random values near them."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if not tensor.is_floating_point() or tensor.numel() < 2:
                continue
            flat = tensor.reshape(-1)
            if not bool(torch.all(flat == flat[0])):
                continue
            noise = torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype)
            if name.endswith("running_var"):
                tensor.copy_(0.5 + noise)  # variances stay positive
            elif float(flat[0]) == 1.0:
                tensor.copy_(0.75 + 0.5 * noise)  # scales stay near 1
            else:
                tensor.copy_(flat[0] + 0.2 * (noise - 0.5))


def _torchvision():
    from tests.exporter.torchvision_import import import_torchvision

    return import_torchvision()


def _tv(name: str, **options) -> Callable[[], nn.Module]:
    return lambda: getattr(_torchvision().models, name)(weights=None, num_classes=CLASSES, **options)


def _vit_b_16_small() -> nn.Module:
    from_module = _torchvision().models.vision_transformer
    return from_module.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
                                         mlp_dim=128, num_classes=CLASSES)


def _swin_t_small() -> nn.Module:
    swin = _torchvision().models.swin_transformer
    return swin.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                                stochastic_depth_prob=0.0, num_classes=CLASSES)


def _timm_vit_tiny() -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=CLASSES, img_size=32)


class Logits(nn.Module):
    """A transformers classifier that returns its logits alone (the exporters want plain tensor outputs)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def _small_config(config_class, **names):
    return config_class(vocab_size=VOCABULARY, num_labels=CLASSES, **names)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = _small_config(BertConfig, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=128, max_position_embeddings=TOKENS * 2, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, classifier_dropout=0.0, attn_implementation="eager")
    return Logits(BertForSequenceClassification(config))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = _small_config(GPT2Config, n_embd=64, n_layer=2, n_head=2, n_positions=TOKENS * 2, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, attn_implementation="eager")
    return Logits(GPT2ForSequenceClassification(config))


class RecurrentClassifier(nn.Module):
    """Token ids -> embedding -> one recurrent layer -> a linear head on the last step's output."""

    def __init__(self, cell: type[nn.RNNBase], width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.rnn = cell(width, width, batch_first=True)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.embed(tokens))
        return self.head(output[:, -1])


_IMAGE, _SMALL_IMAGE = (3, 64, 64), (3, 32, 32)
MODELS = {m.name: m for m in [
    ZooModel("resnet18", _tv("resnet18"), "images", _IMAGE),
    ZooModel("resnet50", _tv("resnet50"), "images", _IMAGE),
    ZooModel("mobilenet_v2", _tv("mobilenet_v2", dropout=0.0), "images", _IMAGE),
    ZooModel("mobilenet_v3_small", _tv("mobilenet_v3_small", dropout=0.0), "images", _IMAGE),
    ZooModel("efficientnet_b0", _tv("efficientnet_b0", dropout=0.0, stochastic_depth_prob=0.0), "images", _IMAGE),
    ZooModel("shufflenet_v2_x0_5", _tv("shufflenet_v2_x0_5"), "images", _IMAGE),
    ZooModel("squeezenet1_1", _tv("squeezenet1_1", dropout=0.0), "images", _IMAGE),
    ZooModel("regnet_x_400mf", _tv("regnet_x_400mf"), "images", _IMAGE),
    ZooModel("densenet121", _tv("densenet121"), "images", _IMAGE),
    ZooModel("convnext_tiny", _tv("convnext_tiny", stochastic_depth_prob=0.0), "images", _IMAGE),
    ZooModel("vit_b_16_small", _vit_b_16_small, "images", _SMALL_IMAGE),
    ZooModel("swin_t_small", _swin_t_small, "images", _SMALL_IMAGE),
    ZooModel("timm_vit_tiny", _timm_vit_tiny, "images", _SMALL_IMAGE),
    ZooModel("bert_small", _bert, "tokens", (TOKENS,)),
    ZooModel("gpt2_small", _gpt2, "tokens", (TOKENS,)),
    ZooModel("lstm_classifier", lambda: RecurrentClassifier(nn.LSTM), "tokens", (TOKENS,)),
    ZooModel("gru_classifier", lambda: RecurrentClassifier(nn.GRU), "tokens", (TOKENS,)),
]}


def export_onnx(module: nn.Module, model: ZooModel, exporter: str, mode: str, path: Path) -> Path:
    """Export ``module`` as a user would: ``exporter`` is "torchscript" (``dynamo=False``, opset 17) or "dynamo"
    (torch's default); ``mode`` "training" exports ``module.train()`` (TorchScript: ``TrainingMode.TRAINING`` and
    no constant folding, as docs/EXPORTER.md recommends), "eval" exports ``module.eval()`` with the defaults
    (TorchScript folds BatchNorm into the convolutions before it). The batch axis is dynamic. The dynamo exporter
    writes the weights beside the model (``MODEL.onnx.data``), as it does by default."""
    if exporter not in EXPORTERS or mode not in MODES:
        raise ValueError(f"exporter {exporter!r} / mode {mode!r}: choose from {EXPORTERS} / {MODES}")
    module.train(mode == "training")
    example = (model.batch(2, seed=0),)
    names = {"input_names": [model.input_name], "output_names": ["logits"]}
    if exporter == "torchscript":
        options = {"dynamo": False, "opset_version": 17,
                   "dynamic_axes": {model.input_name: {0: "N"}, "logits": {0: "N"}}}
        if mode == "training":
            options.update(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    else:
        options = {"dynamo": True,
                   "dynamic_shapes": ({0: torch.export.Dim("N", min=2, max=4096)},)}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(path), **names, **options)
    module.train()
    return path
