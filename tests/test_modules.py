"""`mpsim trace --module`: the CNN zoo, what a block keeps, the CLI end to end, bad specs."""

import json
import textwrap
from pathlib import Path

import pytest
import torch

from mpsim.cli import main
from mpsim.errors import MpsimError
from mpsim.models import cnn
from mpsim.models.modules import trace_builder
from mpsim.models.trace import read_trace_file
from mpsim.studies.hardware_check import model_config

# torchvision's parameter counts at 1000 classes (torchvision.models.*, inception_v3 with aux_logits=False)
TORCHVISION_PARAMS = {"vgg11": 132_863_336, "vgg16": 138_357_544, "vgg19": 143_667_240,
                      "resnet50": 25_557_032, "resnet101": 44_549_160, "inception_v3": 23_834_568}
F32 = 4  # bytes of an fp32 value
I64 = 8  # bytes of a max-pool index


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(TORCHVISION_PARAMS))
def test_zoo_parameter_counts_equal_torchvisions(name):
    with torch.device("meta"):
        blocks, images = cnn.ZOO[name]()
        logits = blocks(images)
    assert sum(p.numel() for p in blocks.parameters()) == TORCHVISION_PARAMS[name]
    assert tuple(logits.shape) == (32, 1000)


def test_zoo_is_cut_into_torchgpipe_layers():
    with torch.device("meta"):
        resnet, _ = cnn.resnet50()
        vgg, _ = cnn.vgg16()
        inception, _ = cnn.inception_v3()
    assert list(resnet._modules)[:2] == ["stem", "layer1_0"] and len(resnet) == 1 + 16 + 1
    assert len(vgg) == 13 + 3 and list(vgg._modules)[1] == "conv2-pool"
    assert len(inception) == 5 + 11 + 1 and "mixed7c" in inception._modules


B, C_IN, C, SIDE = 2, 3, 4, 8  # the tiny net's batch, input channels, channels and image side
TINY = f"""
import torch
from torch import nn


def build():
    blocks = [nn.Conv2d({C_IN}, {C}, 3, padding=1), nn.BatchNorm2d({C}), nn.ReLU(), nn.MaxPool2d(2),
              nn.Sequential(nn.Flatten(), nn.Linear({C} * {SIDE // 2} ** 2, 10))]
    return blocks, torch.randn({B}, {C_IN}, {SIDE}, {SIDE})
"""


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return path


def test_a_tiny_conv_net_keeps_what_its_ops_keep(tiny):
    trace = trace_builder(f"{tiny}:build")
    image = B * C_IN * SIDE * SIDE * F32
    feature = B * C * SIDE * SIDE * F32
    pooled = B * C * (SIDE // 2) ** 2
    expected = {
        "block0-conv2d": image,  # the convolution keeps its input
        "block1-batchnorm2d": feature + 2 * C * F32,  # its input, a mean and an inverse std per channel
        "block2-relu": feature,  # its output
        "block3-maxpool2d": feature + pooled * I64,  # its input and the argmax indices
    }
    rows = {r.name: r for r in trace.layers}
    assert {n: rows[n].act_bytes for n in expected} == expected
    assert [r.kind for r in trace.layers] == ["other"] * 4 + ["head"]
    assert rows["block4-sequential"].act_bytes >= pooled * F32  # the linear keeps its (flattened) input
    assert trace.spec.params == C_IN * C * 9 + C + 2 * C + C * (SIDE // 2) ** 2 * 10 + 10
    assert trace.spec.model["family"] == "module" and trace.spec.precision.recipe == "fp32"


def test_microbatch_traces_again_at_that_batch(tiny):
    small, large = trace_builder(f"{tiny}:build", microbatch=4), trace_builder(f"{tiny}:build", microbatch=8)
    assert (small.microbatch, large.microbatch) == (4, 8)
    doubled = [2 * r.act_bytes for r in small.layers[:4]]
    doubled[1] -= 2 * C * F32  # batch norm's per-channel statistics do not grow with the batch
    assert doubled == [r.act_bytes for r in large.layers[:4]]


def test_module_traces_are_refused_where_they_do_not_apply(tiny):
    trace = trace_builder(f"{tiny}:build")
    with pytest.raises(MpsimError, match="model family 'module' is not one the executor builds"):
        model_config(trace)
    with pytest.raises(MpsimError, match="no transformer layers"):
        trace.with_layers(4)


def test_resnet50_traces_and_simulates_on_one_titan_rtx(capsys, tmp_path):
    out = tmp_path / "resnet50.json"
    code, text, err = run(capsys, "trace", "--module", "mpsim.models.cnn:resnet50", "-o", str(out))
    assert code == 0, err
    assert "resnet50" in text and "18 layers, microbatch 32, fp32" in text
    trace = read_trace_file(out)
    assert trace.spec.params == TORCHVISION_PARAMS["resnet50"]
    assert trace.layers[0].name == "stem" and trace.layers[-1].kind == "head"
    # ResNet-50 is 4.1 GMACs an image at 224 x 224 (He et al. Table 1): 8.2 GFLOPs forward
    assert trace.fwd_flops_total / 32 == pytest.approx(8.2e9, rel=0.02)
    code, _, err = run(capsys, "simulate", "--model", str(out), "--server", "titanrtx-x1", "--microbatches", "4",
                       "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["fits"] is True


def test_a_user_module_file_through_the_cli(capsys, tmp_path, tiny):
    out = tmp_path / "tiny.json"
    code, text, err = run(capsys, "trace", "--module", f"{tiny}:build", "--microbatch", "3", "-o", str(out))
    assert code == 0, err
    trace = read_trace_file(out)
    assert trace.name == "tiny" and trace.microbatch == 3 and trace.n_layers == 5


BAD_BUILDERS = textwrap.dedent("""
    import torch
    from torch import nn

    def only_blocks():
        return [nn.Linear(4, 4)]

    def not_modules():
        return ["conv"], torch.randn(2, 4)

    def mismatched():
        return [nn.Linear(4, 5), nn.Linear(6, 2)], torch.randn(2, 4)

    def needs_depth(depth):
        return [nn.Linear(4, 4)], torch.randn(2, 4)
""")


@pytest.mark.parametrize(("spec", "message"), [
    ("mpsim.models.cnn", "expected package.module:function"),
    ("mpsim.models.cnn:", "expected package.module:function"),
    ("no_such_package_here:build", "cannot import no_such_package_here (ModuleNotFoundError"),
    ("mpsim.models.cnn:resnet9000", "mpsim.models.cnn has no function 'resnet9000'"),
    ("missing/file.py:build", "no file missing/file.py"),
    ("{bad}:only_blocks", "the builder returned list, expected (blocks, example_input)"),
    ("{bad}:not_modules", "the builder's blocks are a list"),
    ("{bad}:mismatched", "block 1 (block1-linear) failed under FakeTensor mode at aten."),
    ("{bad}:needs_depth", "has parameters without defaults"),
])
def test_a_bad_spec_is_one_line_and_exit_2(capsys, tmp_path, spec, message):
    bad = tmp_path / "bad.py"
    bad.write_text(BAD_BUILDERS)
    code, _, err = run(capsys, "trace", "--module", spec.format(bad=bad), "-o", str(tmp_path / "t.json"))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("mpsim: error: ")
    assert message in err


DEEP = """
import torch
from torch import nn


def build():
    unit = lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    return [*(unit() for _ in range(6)), nn.Sequential(nn.Flatten(), nn.Linear(8 * 16 * 16, 10))], \\
        torch.randn(64, 8, 16, 16)
"""


def test_recompute_checkpoints_the_blocks_of_a_module_trace(capsys, tmp_path):
    (tmp_path / "deep.py").write_text(DEEP)
    path = tmp_path / "deep.json"
    assert run(capsys, "trace", "--module", f"{tmp_path / 'deep.py'}:build", "-o", str(path))[0] == 0
    peaks = {}
    for strategy in ("none", "recompute-all"):
        code, out, err = run(capsys, "simulate", "--model", str(path), "--server", "titanrtx-x1", "--microbatches",
                             "1", "--strategy", strategy, "--json", "-")
        assert code == 0, err
        peaks[strategy] = json.loads(out)["gpus"][0]["peak_bytes"]
    # each block keeps its input, the convolution's output, per-channel statistics and the ReLU's output;
    # checkpointed it keeps only its input, so the activations shrink to about a third
    assert peaks["recompute-all"] < 0.6 * peaks["none"]
