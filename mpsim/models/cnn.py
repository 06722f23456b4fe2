"""Image classifiers of the TSPLIT and mCAP experiments, cut into pipeline layers.

Each builder returns ``(blocks, images)`` as ``mpsim trace --module`` expects
(``mpsim.models.modules``): an ``nn.Sequential`` whose named children are the pipeline layers,
in order, and an example batch of images (batch first). The architectures, and so their
parameter counts, equal torchvision's ``vgg11``, ``vgg16``, ``vgg19``, ``resnet50``,
``resnet101`` and ``inception_v3(aux_logits=False)``; they are written here from the papers
because torchvision's compiled operators do not load beside every torch.

The cut follows torchgpipe (Kim et al. 2020, section 3.1: the model flattened into the
sequence of its top-level layers, which the partitioner then balances):

- VGG (Simonyan & Zisserman 2015, Table 1, configurations A, D, E): one layer per 3x3
  convolution with its ReLU, the 2x2 max pool that may follow it included; then the
  classifier's three fully connected layers, one each.
- ResNet (He et al. 2016, Table 1; bottleneck "v1.5": the stride on the 3x3 convolution,
  as torchvision): the stem (7x7 convolution, batch norm, ReLU, max pool), each bottleneck
  block, then global average pool and the fully connected layer.
- Inception-v3 (Szegedy et al. 2016, Table 1 and figures 5-7, 10): each stem
  convolution (with the max pool that follows it), each Inception module, then pool,
  dropout and the fully connected layer. No auxiliary classifier.

Dropout calls ``mpsim.models.kernels.dropout`` (a 1-byte mask, as CUDA keeps). ReLUs are in
place, as torchvision's: no layer keeps a convolution's output twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mpsim.models import kernels

IMAGE_SIZE = 224
"""Pixels a side of the ImageNet crops VGG and ResNet are trained on."""
INCEPTION_IMAGE_SIZE = 299
BATCH = 32
CLASSES = 1000
Built = tuple[nn.Sequential, Tensor]


class Dropout(nn.Module):
    """Dropout with CUDA's saved tensors (``kernels.dropout``)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return kernels.dropout(x, self.p, self.training)


def _images(batch: int, size: int) -> Tensor:
    return torch.randn(batch, 3, size, size)


def _check_width(width: int) -> None:
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive integer, got {width!r}")


# --- VGG -------------------------------------------------------------------------------------

_POOL = 0
"""Marks a 2x2 max pool in a VGG configuration."""
VGG_CONFIGS: dict[str, list[int]] = {
    "vgg11": [64, _POOL, 128, _POOL, 256, 256, _POOL, 512, 512, _POOL, 512, 512, _POOL],
    "vgg16": [64, 64, _POOL, 128, 128, _POOL, 256, 256, 256, _POOL, 512, 512, 512, _POOL, 512, 512, 512, _POOL],
    "vgg19": [64, 64, _POOL, 128, 128, _POOL, 256, 256, 256, 256, _POOL, 512, 512, 512, 512, _POOL,
              512, 512, 512, 512, _POOL],
}


def _vgg_features(config: Sequence[int], scale: int = 1) -> list[tuple[str, nn.Module]]:
    """One layer per 3x3 convolution and ReLU; a following max pool joins that layer.
    ``scale`` multiplies every convolution's output channels (TSPLIT VI-B, Table V)."""
    layers: list[tuple[str, nn.Module]] = []
    channels = 3
    for base in config:
        width = base * scale
        if base == _POOL:
            name, last = layers[-1]
            layers[-1] = (name + "-pool", nn.Sequential(*last.children(), nn.MaxPool2d(kernel_size=2, stride=2)))
            continue
        layers.append((f"conv{len(layers) + 1}", nn.Sequential(
            nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True))))
        channels = width
    return layers


def _vgg_classifier(classes: int, dropout: float, channels: int = 512) -> list[tuple[str, nn.Module]]:
    """The three fully connected layers; the first pools to 7x7 and flattens (any image size)."""
    fc_width = 4096
    return [
        ("fc1", nn.Sequential(nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten(), nn.Linear(channels * 7 * 7, fc_width),
                              nn.ReLU(inplace=True), Dropout(dropout))),
        ("fc2", nn.Sequential(nn.Linear(fc_width, fc_width), nn.ReLU(inplace=True), Dropout(dropout))),
        ("fc3", nn.Sequential(nn.Linear(fc_width, classes))),
    ]


def vgg(config: str, batch: int = BATCH, image_size: int = IMAGE_SIZE, classes: int = CLASSES,
        dropout: float = 0.5, width: int = 1) -> Built:
    """VGG without batch norm (configuration A, D or E of Simonyan & Zisserman, Table 1);
    ``width`` multiplies the convolutions' channels (TSPLIT's parameter scale k, VI-B), the
    fully connected layers keep 4096 units."""
    _check_width(width)
    layers = _vgg_features(VGG_CONFIGS[config], width) + _vgg_classifier(classes, dropout, 512 * width)
    return nn.Sequential(OrderedDict(layers)), _images(batch, image_size)


def vgg11(batch: int = BATCH, image_size: int = IMAGE_SIZE, classes: int = CLASSES) -> Built:
    """VGG-11 (configuration A): 132,863,336 parameters at 1000 classes."""
    return vgg("vgg11", batch, image_size, classes)


def vgg16(batch: int = BATCH, image_size: int = IMAGE_SIZE, classes: int = CLASSES) -> Built:
    """VGG-16 (configuration D): 138,357,544 parameters at 1000 classes."""
    return vgg("vgg16", batch, image_size, classes)


def vgg19(batch: int = BATCH, image_size: int = IMAGE_SIZE, classes: int = CLASSES) -> Built:
    """VGG-19 (configuration E): 143,667,240 parameters at 1000 classes."""
    return vgg("vgg19", batch, image_size, classes)


# --- ResNet ----------------------------------------------------------------------------------


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    """A bias-free convolution (padding keeps the size at stride 1) and its batch norm."""
    return [nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)]


class Bottleneck(nn.Module):
    """He et al. 2016, figure 5 right: 1x1 reduce, 3x3 (strided when downsampling), 1x1
    expand by 4, added to the shortcut (a strided 1x1 projection when the shape changes)."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.residual = nn.Sequential(
            *_conv_bn(c_in, width, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            *_conv_bn(width, c_out, 1))
        self.shortcut = (nn.Sequential(*_conv_bn(c_in, c_out, 1, stride)) if stride != 1 or c_in != c_out
                         else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.residual(x) + self.shortcut(x))


RESNET_DEPTHS: dict[str, tuple[int, ...]] = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}


def resnet(depth: str, batch: int = BATCH, image_size: int = IMAGE_SIZE, classes: int = CLASSES,
           width: int = 1) -> Built:
    """A bottleneck ResNet of He et al. Table 1: stem, four stages of blocks, pool and fc;
    ``width`` multiplies every convolution's channels (TSPLIT's parameter scale k, VI-B)."""
    _check_width(width)
    stem_width = 64 * width
    layers: list[tuple[str, nn.Module]] = [("stem", nn.Sequential(
        *_conv_bn(3, stem_width, 7, stride=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1)))]
    c_in = stem_width
    for stage, blocks in enumerate(RESNET_DEPTHS[depth]):
        width = stem_width * 2**stage
        for i in range(blocks):
            stride = 2 if i == 0 and stage > 0 else 1
            layers.append((f"layer{stage + 1}_{i}", Bottleneck(c_in, width, stride)))
            c_in = width * Bottleneck.expansion
    layers.append(("pool-fc", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes))))
    return nn.Sequential(OrderedDict(layers)), _images(batch, image_size)


def resnet50(batch: int = BATCH, image_size: int = IMAGE_SIZE, classes: int = CLASSES) -> Built:
    """ResNet-50: 25,557,032 parameters at 1000 classes; 18 pipeline layers."""
    return resnet("resnet50", batch, image_size, classes)


def resnet101(batch: int = BATCH, image_size: int = IMAGE_SIZE, classes: int = CLASSES) -> Built:
    """ResNet-101: 44,549,160 parameters at 1000 classes; 35 pipeline layers."""
    return resnet("resnet101", batch, image_size, classes)


# --- Inception-v3 ----------------------------------------------------------------------------

Kernel = int | tuple[int, int]


def conv(c_in: int, c_out: int, kernel: Kernel, stride: int = 1, padding: Kernel = 0) -> nn.Sequential:
    """Inception's unit: a bias-free convolution, batch norm (eps 0.001) and ReLU."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, bias=False),
                         nn.BatchNorm2d(c_out, eps=0.001), nn.ReLU(inplace=True))


def _avg_pool_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(kernel_size=3, stride=1, padding=1), conv(c_in, c_out, 1))


def _one_by_n(c_in: int, c_out: int, n: int) -> nn.Sequential:
    return conv(c_in, c_out, (1, n), padding=(0, n // 2))


def _n_by_one(c_in: int, c_out: int, n: int) -> nn.Sequential:
    return conv(c_in, c_out, (n, 1), padding=(n // 2, 0))


class Branches(nn.Module):
    """Parallel branches on one input, concatenated along the channels (an Inception module)."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([b(x) for b in self.branches], dim=1)


def _split(stem: nn.Module, c_in: int, c_out: int) -> nn.Sequential:
    """``stem`` then a 1x3 and a 3x1 convolution side by side (figure 7's expanded filter bank)."""
    return nn.Sequential(stem, Branches(_one_by_n(c_in, c_out, 3), _n_by_one(c_in, c_out, 3)))


def inception_35(c_in: int, pool_width: int) -> Branches:
    """The 35x35 module (figure 5, the 5x5 kept as torchvision's): 64 + 64 + 96 + pool_width channels."""
    return Branches(conv(c_in, 64, 1),
                    nn.Sequential(conv(c_in, 48, 1), conv(48, 64, 5, padding=2)),
                    nn.Sequential(conv(c_in, 64, 1), conv(64, 96, 3, padding=1), conv(96, 96, 3, padding=1)),
                    _avg_pool_conv(c_in, pool_width))


def reduce_35_to_17(c_in: int) -> Branches:
    """Grid reduction 35 -> 17 (figure 10): strided 3x3 branches beside a max pool; 768 channels out of 288."""
    return Branches(conv(c_in, 384, 3, stride=2),
                    nn.Sequential(conv(c_in, 64, 1), conv(64, 96, 3, padding=1), conv(96, 96, 3, stride=2)),
                    nn.MaxPool2d(kernel_size=3, stride=2))


def inception_17(c_in: int, width: int) -> Branches:
    """The 17x17 module with 7x7 factorised into 1x7 and 7x1 (figure 6, n = 7): 768 channels."""
    out = 192
    return Branches(conv(c_in, out, 1),
                    nn.Sequential(conv(c_in, width, 1), _one_by_n(width, width, 7), _n_by_one(width, out, 7)),
                    nn.Sequential(conv(c_in, width, 1), _n_by_one(width, width, 7), _one_by_n(width, width, 7),
                                  _n_by_one(width, width, 7), _one_by_n(width, out, 7)),
                    _avg_pool_conv(c_in, out))


def reduce_17_to_8(c_in: int) -> Branches:
    """Grid reduction 17 -> 8: 320 + 192 channels of strided convolutions beside a max pool (1280 out of 768)."""
    return Branches(nn.Sequential(conv(c_in, 192, 1), conv(192, 320, 3, stride=2)),
                    nn.Sequential(conv(c_in, 192, 1), _one_by_n(192, 192, 7), _n_by_one(192, 192, 7),
                                  conv(192, 192, 3, stride=2)),
                    nn.MaxPool2d(kernel_size=3, stride=2))


def inception_8(c_in: int) -> Branches:
    """The 8x8 module with expanded filter banks (figure 7): 320 + 768 + 768 + 192 = 2048 channels."""
    return Branches(conv(c_in, 320, 1),
                    _split(conv(c_in, 384, 1), 384, 384),
                    _split(nn.Sequential(conv(c_in, 448, 1), conv(448, 384, 3, padding=1)), 384, 384),
                    _avg_pool_conv(c_in, 192))


def inception_v3(batch: int = BATCH, image_size: int = INCEPTION_IMAGE_SIZE, classes: int = CLASSES,
                 dropout: float = 0.5) -> Built:
    """Inception-v3 without the auxiliary classifier: 23,834,568 parameters at 1000 classes; 17 pipeline layers."""
    pool = nn.MaxPool2d(kernel_size=3, stride=2)
    layers: list[tuple[str, nn.Module]] = [
        ("conv1", conv(3, 32, 3, stride=2)),
        ("conv2", conv(32, 32, 3)),
        ("conv3-pool", nn.Sequential(conv(32, 64, 3, padding=1), pool)),
        ("conv4", conv(64, 80, 1)),
        ("conv5-pool", nn.Sequential(conv(80, 192, 3), nn.MaxPool2d(kernel_size=3, stride=2))),
        ("mixed5b", inception_35(192, 32)),
        ("mixed5c", inception_35(256, 64)),
        ("mixed5d", inception_35(288, 64)),
        ("mixed6a", reduce_35_to_17(288)),
        ("mixed6b", inception_17(768, 128)),
        ("mixed6c", inception_17(768, 160)),
        ("mixed6d", inception_17(768, 160)),
        ("mixed6e", inception_17(768, 192)),
        ("mixed7a", reduce_17_to_8(768)),
        ("mixed7b", inception_8(1280)),
        ("mixed7c", inception_8(2048)),
        ("pool-fc", nn.Sequential(nn.AdaptiveAvgPool2d(1), Dropout(dropout), nn.Flatten(),
                                  nn.Linear(2048, classes))),
    ]
    return nn.Sequential(OrderedDict(layers)), _images(batch, image_size)


ZOO = {"vgg11": vgg11, "vgg16": vgg16, "vgg19": vgg19, "resnet50": resnet50, "resnet101": resnet101,
       "inception_v3": inception_v3}
"""Builders by name: ``mpsim trace --module mpsim.models.cnn:NAME``."""

PARAMS = {"vgg11": 132_863_336, "vgg16": 138_357_544, "vgg19": 143_667_240, "resnet50": 25_557_032,
          "resnet101": 44_549_160, "inception_v3": 23_834_568}
"""torchvision's parameter counts of the same models at 1000 classes (inception_v3 without aux logits)."""
