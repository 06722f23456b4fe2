"""Fine-tuning (issue 50): trainable and frozen parameters against PEFT's own count on
transformers models built on the meta device; model-state bytes per parameter for full
fine-tuning, LoRA and QLoRA (bitsandbytes' layout, QLoRA section 3); what autograd keeps
for a frozen linear layer with and without an adapter, against autograd's own saved
tensors on real tensors; the flags, and what they refuse in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mpsim import api
from mpsim.cli import main
from mpsim.errors import MpsimError
from mpsim.models import adapters, finetune, kernels
from mpsim.models.hf import trace_hf
from mpsim.models.hf_fields import shipped_configs
from mpsim.models.tracer import compute_dtype, trace_layer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _peft_counts(config_name: str, lora: dict, layers: int | None = None) -> tuple[int, int]:
    """(trainable, all) as PEFT counts them on the transformers model built on the meta device."""
    config = transformers.AutoConfig.from_pretrained(str(shipped_configs()[config_name]))
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    return model.get_nb_trainable_parameters()


CASES: dict[str, tuple[str, int | None, dict[str, Any]]] = {
    "llama-3-8b r16 all-linear": ("llama-3-8b", None, {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}),
    "mistral-7b r8 q,v": ("mistral-7b", 2, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
    "qwen2.5-7b DoRA r4": ("qwen2.5-7b", 2, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                             "use_dora": True}),
    "tinyllama lm_head saved": ("tinyllama-1.1b", 2, {"r": 8, "lora_alpha": 16, "target_modules": ["o_proj"],
                                                      "modules_to_save": ["lm_head"]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainable_and_total_parameters_equal_peft(case: str) -> None:
    name, layers, lora = CASES[case]
    trainable, total = _peft_counts(name, lora, layers)
    spec = finetune.FineTune.model_validate({"method": "lora", "lora_dropout": 0.0, **lora})
    trace = trace_hf(name, overrides={"layers": layers} if layers else None, fine_tune=spec)
    assert (trace.trained_params, trace.spec.params) == (trainable, total)
    assert sum(r.params - r.frozen_params for r in trace.layers) == trainable


def test_llama_3_8b_lora_is_the_published_count() -> None:
    """r 16 on every linear layer of Llama-3-8B: 16 x (4096 + 4096 + 2 x (4096 + 1024) + 4096 + 4096 + 3 x
    (4096 + 14336)) per layer, 32 layers."""
    per_layer = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    trace = api.at_finetune(api.load_trace("llama-3-8b"), finetune.lora())
    assert trace.trained_params == 32 * per_layer == 41_943_040
    assert trace.spec.params == 8_030_261_248 + 41_943_040


@pytest.fixture(scope="module")
def tiny_traces() -> dict[str, api.Trace]:
    """TinyLlama's shape with 2 layers at 256 tokens: full training, LoRA and QLoRA."""
    kw = {"overrides": {"layers": 2, "seq_len": 256}, "recipe": "mixed-bf16"}
    return {"full": trace_hf("tinyllama-1.1b", **kw),  # type: ignore[arg-type]
            "lora": trace_hf("tinyllama-1.1b", fine_tune=finetune.lora(8), **kw),  # type: ignore[arg-type]
            "qlora": trace_hf("tinyllama-1.1b", fine_tune=finetune.qlora(8), **kw)}  # type: ignore[arg-type]


def test_model_state_bytes_per_parameter(tiny_traces: dict[str, api.Trace]) -> None:
    """Full fine-tuning: 16 bytes a parameter (mixed bf16 Adam). LoRA: 2 per frozen
    weight, 16 per adapter weight. QLoRA: the blocks' linear weights as bitsandbytes stores
    them, the rest of the base in bf16, adapters at 16."""
    full, lora, qlora = tiny_traces["full"], tiny_traces["lora"], tiny_traces["qlora"]
    for r in full.layers:
        assert (r.param_bytes + r.grad_bytes + r.optimizer_bytes, r.frozen_params) == (16 * r.params, 0)
    for r in lora.layers:
        trained = r.params - r.frozen_params
        assert (r.param_bytes, r.grad_bytes, r.optimizer_bytes) == (2 * r.params, 2 * trained, 12 * trained)
    block = qlora.layers[1]
    h, ffn, kv = 2048, 5632, 256
    linears = [h * h, h * kv, h * kv, h * h, h * ffn, h * ffn, ffn * h]  # q, k, v, o, gate, up, down

    def stored(n: int) -> int:  # packed values, 8-bit absmax per 64, fp32 per 256 absmaxes, code and offset
        blocks = math.ceil(n / 64)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + finetune.CODE_BYTES

    assert block.frozen_param_bytes == sum(stored(n) for n in linears) + 2 * 2 * h  # two RMSNorm weights in bf16
    assert block.frozen_params == sum(linears) + 2 * h
    assert block.trained_params == lora.layers[1].trained_params
    assert qlora.layers[0].frozen_param_bytes == lora.layers[0].frozen_param_bytes  # the embedding stays bf16


def test_qlora_bits_per_parameter_are_the_papers() -> None:
    """QLoRA section 3: the constants take 32/64 = 0.5 bits a parameter, 8/64 + 32/(64 x 256) =
    0.127 with double quantization."""
    assert (finetune.quant_bytes_per_param("nf4", False) - 0.5) * 8 == pytest.approx(0.5)
    assert (finetune.quant_bytes_per_param("nf4", True) - 0.5) * 8 == pytest.approx(0.127, abs=5e-4)
    assert finetune.quant_bytes_per_param("int8") == 1.0


def _autograd_saved(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of ``module(x)`` on real tensors: each storage
    once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    return sum(saved.values())


def _with_adapter(base: nn.Module, dropout: float) -> nn.Module:
    model = nn.Sequential(base)
    with adapters._adapters_in_place():  # as mpsim injects them: fake parameters cannot be moved
        peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"],
                                                     lora_dropout=dropout), model)
    return model


@pytest.mark.parametrize("kind", ["frozen", "trained", "frozen + adapter"])
def test_saved_bytes_of_a_linear_layer_are_autograds(kind: str) -> None:
    """A frozen linear layer keeps its weight only, not its input; a trained one its input;
    a frozen one with a LoRA adapter the input (read by A) and A's output (read by B)."""
    torch.manual_seed(0)

    def build() -> nn.Module:
        base = nn.Linear(64, 32)
        if kind != "trained":
            base.requires_grad_(False)
        return _with_adapter(base, 0.0) if "adapter" in kind else base

    real = _autograd_saved(build(), torch.randn(2, 8, 64, requires_grad=True))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        traced = trace_layer(build(), [torch.randn(2, 8, 64, requires_grad=True)], lambda m, x: m(x),
                             fixed_traffic=False)
    expected = {"frozen": 0, "trained": 2 * 8 * 64 * 4, "frozen + adapter": 2 * 8 * (64 + 4) * 4}[kind]
    assert real == traced["act_bytes"] == expected


def test_adapter_dropout_keeps_cudas_mask_and_its_output() -> None:
    """With dropout, A reads a dropped copy of the input: autograd keeps that copy and CUDA's
    1-byte mask, not the input."""
    with compute_dtype("mixed-bf16"), torch._subclasses.fake_tensor.FakeTensorMode():
        base = nn.Linear(64, 32).requires_grad_(False)
        x = torch.randn(2, 8, 64, requires_grad=True)
        model = _with_adapter(base, 0.1)
        with kernels.CudaDropout():
            traced = trace_layer(model, [x], lambda m, t: m(t), fixed_traffic=False)
    assert traced["act_bytes"] == 2 * 8 * 64 * (2 + 1) + 2 * 8 * 4 * 2


def test_a_quantized_layer_keeps_nothing_and_dequantizes_each_pass() -> None:
    """bitsandbytes' 4-bit matmul with a frozen weight: nothing saved but the packed weight
    (a parameter); the full weight written by the dequantization in the forward and again in
    the backward, the forward's transient workspace."""
    with torch._subclasses.fake_tensor.FakeTensorMode():
        layer = adapters.QuantizedLinear(nn.Linear(256, 128, bias=False, dtype=torch.bfloat16), "nf4", True)
        x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
        traced = trace_layer(layer, [x], lambda m, t: m(t), fixed_traffic=False)
    n = 256 * 128
    packed = n // 2 + n // 64 + 4 * math.ceil(n / 64 / 256) + finetune.CODE_BYTES
    assert traced["act_bytes"] == 0
    assert traced["workspace_bytes"] == 2 * n
    assert traced["fwd_mem_bytes"] == packed + 2 * n
    assert traced["bwd_mem_bytes"] >= packed + 2 * n
    assert (traced["frozen_params"], traced["frozen_param_bytes"]) == (n, packed)
    assert traced["fwd_flops"] == 2 * 4 * 256 * 128 and traced["bwd_flops"] == 2 * 4 * 256 * 128


def test_single_gpu_memory_is_the_traces_model_states(tiny_traces: dict[str, api.Trace]) -> None:
    """On one GPU the simulated gradients and optimizer states are the trained parameters'
    bytes, and QLoRA's weights are its stored ones."""
    topo = api.load_topology("rtx4090-x1")
    for name in ("lora", "qlora"):
        trace = tiny_traces[name]
        result = api.simulate(topo, trace, schedule="1f1b", microbatch=1, microbatches=1)
        peak = result.gpus[0].breakdown
        assert peak["grads"] == sum(r.grad_bytes for r in trace.layers)
        assert peak["optimizer"] == sum(r.optimizer_bytes for r in trace.layers)
        assert peak["params"] == sum(r.param_bytes for r in trace.layers)
    lora, qlora = (api.simulate(topo, tiny_traces[n], microbatch=1, microbatches=1) for n in ("lora", "qlora"))
    assert qlora.max_peak_bytes < lora.max_peak_bytes


def test_peft_saved_config_is_read(tmp_path: Path) -> None:
    """Every key PEFT writes by default is accepted; what changes memory is kept."""
    peft.LoraConfig(r=32, lora_alpha=64, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                    task_type="CAUSAL_LM").save_pretrained(str(tmp_path))
    spec = finetune.read_peft_config(tmp_path)
    assert (spec.r, spec.lora_alpha, spec.lora_dropout, sorted(spec.target_modules)) == (32, 64, 0.1,
                                                                                          ["q_proj", "v_proj"])
    assert finetune.read_peft_config(tmp_path, "nf4").quant == "nf4"


@pytest.mark.parametrize("key, value", [("layers_to_transform", [0, 1]), ("rank_pattern", {"q_proj": 4}),
                                        ("bias", "all"), ("peft_type", "IA3")])
def test_peft_config_options_not_modelled_are_refused(tmp_path: Path, key: str, value: object) -> None:
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"r": 8, "target_modules": ["q_proj"], key: value}))
    with pytest.raises(MpsimError, match=key if key != "peft_type" else "IA3") as e:
        finetune.read_peft_config(path)
    assert "\n" not in str(e.value)


REFUSED = {
    "both": (["--lora", "--qlora"], "give one"),
    "rank alone": (["--lora-rank", "8"], "give --lora or --qlora too"),
    "no config": (["--model", "gpt-5.3b", "--lora"], "no shipped Hugging Face config.json"),
    "moe": (["--model", "mixtral-8x7b", "--lora"], "mixture of experts"),
    "fp8": (["--model", "llama-3-8b", "--recipe", "fp8-delayed", "--lora"], "16- and 32-bit recipes"),
    "tensor parallel": (["--lora", "--tp", "2"], "tensor parallelism of a fine-tune"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_in_one_line(capsys: pytest.CaptureFixture[str], case: str) -> None:
    args, message = REFUSED[case]
    base = ["simulate", "--server", "dgx-a100-80gb", "--model", "tinyllama-1.1b", "--microbatches", "2"]
    code = main([*base, *args])
    err = capsys.readouterr().err
    assert code != 0 and message in err, err
    assert len([line for line in err.splitlines() if line.strip()]) <= 2, err  # usage line and the message


def test_choose_tokens_refuses_fine_tuning(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["choose", "--model", "llama-3-8b", "--tokens", "1e9", "--lora"])
    assert code == 2 and "pre-training" in capsys.readouterr().err


def test_simulate_names_the_fine_tune(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--server", "rtx4090-x1", "--model", "tinyllama-1.1b", "--qlora", "--lora-rank", "8",
                 "--seq-len", "512", "--microbatches", "1", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["model"].endswith("-qlora-r8")


def test_trace_writes_a_fine_tune_that_simulate_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mpsim trace --hf ... --qlora`` records the fine-tune; the file simulates as the flag does."""
    out = tmp_path / "q.json"
    assert main(["trace", "--hf", "tinyllama-1.1b", "--qlora", "--lora-rank", "8", "--layers", "2", "-o",
                 str(out)]) == 0
    assert "trained: QLoRA r 8" in capsys.readouterr().out
    saved = api.load_trace(str(out))
    assert saved.spec.finetune == finetune.qlora(8)
    assert main(["trace", "--preset", "gpt-5.3b", "--lora", "-o", str(tmp_path / "g.json")]) != 0
    assert "no shipped Hugging Face config.json" in capsys.readouterr().err


def test_fits_takes_a_fine_tune(capsys: pytest.CaptureFixture[str]) -> None:
    """``fits --qlora``: each model its fine-tune (written as files its workers load), named so."""
    argv = ["fits", "--model", "tinyllama-1.1b", "--qlora", "--server", "rtx4090-x1", "--strategy", "none",
            "--no-largest", "-j", "1"]
    assert main([*argv, "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["reports"][0]["rows"]
    assert [(r["model"], r["fits"]) for r in rows] == [("tinyllama-1.1b-qlora-r16", True)]
    assert main(argv) == 0
    assert "fine-tune: QLoRA r 16 on all-linear" in capsys.readouterr().out


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_shards_only_what_trains(tiny_traces: dict[str, api.Trace], zero: int) -> None:
    """Over two replicas the trained parameters' optimizer states shard as ZeRO says, and
    the weights are held whole except under FSDP (ZeRO-3), which shards frozen and trained
    parameters alike (FSDP2): its peak holds a shard and the layers gathered around it."""
    from mpsim.plans.mesh import data_parallel

    trace = tiny_traces["lora"]
    topo = api.load_topology("rtx4090-x2")
    result = api.simulate(topo, trace, microbatch=1, microbatches=2, parallelism=data_parallel(2, zero, 1))
    peak = result.gpus[0].breakdown
    optimizer = sum(r.optimizer_bytes for r in trace.layers)
    weights = sum(r.param_bytes for r in trace.layers)
    assert result.fits
    assert peak["optimizer"] == (optimizer if zero == 0 else -(-optimizer // 2))
    assert (peak["params"] == weights) == (zero < 3)


def test_a_plan_records_its_fine_tune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan made for a fine-tune says so; ``simulate --plan`` with the model runs that
    fine-tune; a plan run under another fine-tune, or under none, is refused in one line."""
    lora, full = tmp_path / "lora.json", tmp_path / "full.json"
    base = ["--model", "tinyllama-1.1b", "--server", "rtx4090-x1", "--microbatches", "1", "--strategy", "recompute"]
    assert main(["plan", *base, "--lora", "-o", str(lora), "--json", "-"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["plan"]["finetune"]["method"] == "lora"
    assert main(["plan", *base, "-o", str(full), "--json", "-"]) == 0
    assert "finetune" not in json.loads(capsys.readouterr().out)["plan"]
    assert main(["simulate", "--plan", str(lora), "--model", "tinyllama-1.1b", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_s"] == made["result"]["iteration_s"]
    for argv, message in ((["--plan", str(lora)], "give --model"),
                          (["--plan", str(lora), "--model", "tinyllama-1.1b", "--qlora"], "made for LoRA"),
                          (["--plan", str(full), "--model", "tinyllama-1.1b", "--lora"], "made for full training")):
        assert main(["simulate", *argv]) != 0
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def llama_lora_4k() -> api.Trace:
    return api.retraced(api.load_trace("llama-3-8b"), 4096, None, finetune.lora())


@pytest.mark.parametrize("strategy", ["mpress", "tsplit", "d2d"])
def test_memory_saving_strategies_fit_a_fine_tune_that_does_not_fit_as_is(llama_lora_4k: api.Trace,
                                                                          strategy: str) -> None:
    """Llama-3-8B with LoRA at 4k tokens on a DGX-1 (32 GB V100s, eight stages) runs out of
    memory as it is; MPress, TSPLIT and the swap to peers plan it to fit, frozen weights and
    all."""
    topo = api.load_topology("dgx1-v100")
    assert not api.simulate(topo, llama_lora_4k, microbatch=1, microbatches=8).fits
    result = api.simulate(topo, llama_lora_4k, microbatch=1, microbatches=8, strategy=strategy)
    assert result.fits
    assert all(g.breakdown["optimizer"] < 2**30 for g in result.gpus)  # the adapters' states only
