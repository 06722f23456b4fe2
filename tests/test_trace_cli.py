"""`mpsim trace` shapes, attention kernels and presets, and `mpsim fits --model`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpsim.cli import main

Capture = pytest.CaptureFixture[str]


def run(capsys: Capture, *argv: str) -> tuple[int, str]:
    """Exit code and what the command printed (standard output and error together)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def traced(capsys: Capture, tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "t.json"
    code, text = run(capsys, "trace", "-o", str(out), *argv)
    assert code == 0, text
    return json.loads(out.read_text())


SMALL = ("--layers", "2", "--hidden", "256", "--heads", "4", "--seq-len", "128", "--vocab", "1000")


@pytest.mark.parametrize(("server", "kernel"), [("dgx1-v100", "mem-efficient"), ("titanrtx-x1", "mem-efficient"),
                                                ("dgx-a100-80gb", "flash"), ("dgx-h100", "flash")])
def test_attention_defaults_to_what_pytorch_picks_on_the_servers_gpus(capsys, tmp_path, server, kernel):
    assert traced(capsys, tmp_path, *SMALL, "--server", server)["model"]["attention"] == kernel


def test_a_preset_keeps_its_kernel_and_a_shape_without_server_gets_flash(capsys, tmp_path):
    assert traced(capsys, tmp_path, "--preset", "gpt-5.3b", "--layers", "1")["model"]["attention"] == "eager"
    assert traced(capsys, tmp_path, *SMALL)["model"]["attention"] == "flash"
    assert traced(capsys, tmp_path, *SMALL, "--attention", "fused-softmax")["model"]["attention"] == "fused-softmax"


def test_eager_keeps_quadratic_bytes_and_flash_linear(capsys, tmp_path):
    def block_bytes(kernel: str, seq: int) -> int:
        t = traced(capsys, tmp_path, "--family", "gpt", "--layers", "1", "--hidden", "256", "--heads", "4",
                   "--vocab", "100", "--seq-len", str(seq), "--attention", kernel)
        return t["layers"][1]["act_bytes"]

    assert block_bytes("flash", 512) == pytest.approx(2 * block_bytes("flash", 256), rel=0.01)
    assert block_bytes("eager", 512) > 2.5 * block_bytes("eager", 256)


def test_llama_shape_with_grouped_query_attention(capsys, tmp_path):
    t = traced(capsys, tmp_path, "--family", "llama", *SMALL, "--kv-heads", "2", "--ffn-hidden", "704")
    h, kv_dim, f, v = 256, 2 * 64, 704, 1000
    layer = h * (h + 2 * kv_dim) + h * h + 3 * h * f + 2 * h
    assert t["params"] == 2 * v * h + 2 * layer + h
    assert t["layers"][1]["params"] == layer and t["model"]["kv_heads"] == 2


def test_dropout_zero_keeps_no_masks(capsys, tmp_path):
    with_masks = traced(capsys, tmp_path, *SMALL, "--attention", "flash")["layers"][1]["act_bytes"]
    without = traced(capsys, tmp_path, *SMALL, "--attention", "flash", "--dropout", "0")["layers"][1]["act_bytes"]
    assert with_masks - without == 2 * 128 * 2 * 256  # two 1-byte residual masks of s*b*h


@pytest.mark.parametrize(("argv", "message"), [
    (("--family", "llama", "--heads", "40", "--kv-heads", "3"), "heads 40 is not divisible by kv_heads 3"),
    (("--preset", "llama-9b"), "unknown --preset 'llama-9b'"),
    (("--server", "nowhere-x9"), "nowhere-x9"),
])
def test_bad_shapes_are_one_line(capsys, tmp_path, argv, message):
    code, text = run(capsys, "trace", "-o", str(tmp_path / "x.json"), *argv)
    assert code == 2 and message in text and len(text.strip().splitlines()) == 1


def test_list_names_every_preset(capsys):
    code, text = run(capsys, "trace", "--list")
    assert code == 0
    for preset in ("llama-2-7b", "llama-3-70b", "mistral-7b", "qwen2.5-7b", "gpt2-xl", "gpt-5.3b"):
        assert preset in text


def test_fits_takes_models_instead_of_a_family(capsys):
    code, text = run(capsys, "fits", "--server", "dgx-h100", "--model", "llama-2-7b,llama-3-8b", "--strategy", "none",
                     "--json", "-")
    assert code == 0, text
    report = json.loads(text)["reports"][0]
    assert [r["model"] for r in report["rows"]] == ["llama-2-7b", "llama-3-8b"]
    assert all(r["fits"] for r in report["rows"])
    assert report["largest"]["params"] > 8_030_261_248  # 8 x 80 GB holds more layers at Llama-3-8B's shape
