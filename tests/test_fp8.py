"""FP8 recipes: which GEMMs run in FP8, the casts' bytes, what the backward keeps of a GEMM's
input, the weights' cached copies, the GEMMs at the FP8 rate, and a GPU without FP8 refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from mpsim.data.catalog import load_topology
from mpsim.errors import MpsimError
from mpsim.hardware.kernel_records import GemmKernel
from mpsim.models import low_precision
from mpsim.models.trace import RECIPES
from mpsim.models.tracer import trace_layer
from mpsim.timing.costs import cost_model, kernel_rates
from mpsim.timing.kernel_time import gemm_seconds, kernel_seconds

T, A, B, C = 64, 32, 48, 16
"""Tokens, and the widths of two linear layers in a row: T x A -> T x B -> T x C."""


def _two_linears(recipe: str) -> dict:
    """x -> Linear(A, B) -> Linear(B, C), no bias, traced in bf16 under ``recipe``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode(), low_precision.recipe(RECIPES[recipe]):
            block = nn.Sequential(nn.Linear(A, B, bias=False), nn.Linear(B, C, bias=False))
            x = torch.randn(T, A, requires_grad=True)
            return trace_layer(block, [x], lambda m, t: m(t), fixed_traffic=False)
    finally:
        torch.set_default_dtype(previous)


def test_bf16_keeps_the_input_and_the_hidden_state_in_bf16() -> None:
    row = _two_linears("mixed-bf16")
    assert row["act_bytes"] == 2 * T * A + 2 * T * B
    assert not any(k.get("low_precision") for k in row["fwd_kernels"] + row["bwd_kernels"])


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-current", "mxfp8", "fp8-blockwise", "nvfp4"])
def test_a_saved_gemm_input_is_kept_as_one_quantized_copy(recipe: str) -> None:
    """The hidden state is read in the backward only by the second GEMM's weight gradient:
    one quantized copy (bytes and scales); the layer's input stays whole."""
    p = RECIPES[recipe]
    row = _two_linears(recipe)
    assert row["act_bytes"] == 2 * T * A + round(T * B * p.quantized_bytes)


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-current"])
def test_every_gemm_runs_in_fp8_and_each_cast_moves_its_reads_and_copies(recipe: str) -> None:
    """Forward: two GEMMs, each with its activation and its weight cast (read 2 bytes an
    element, twice under current scaling; write two 1-byte copies). Backward: the data
    gradients (the output's gradient cast first) and the weight gradients, all four FP8;
    the first layer's data gradient too, since the input needs its gradient."""
    p = RECIPES[recipe]
    row = _two_linears(recipe)
    gemms = [k for k in row["fwd_kernels"] if k["op"] == "gemm"]
    assert len(gemms) == 2 and all(k["low_precision"] for k in gemms)
    assert sum(k["count"] for k in row["bwd_kernels"] if k["op"] == "gemm" and k.get("low_precision")) == 4

    def cast(n: int) -> int:
        return n * 2 * (2 if p.amax_pass else 1) + n * 2

    bf16 = _two_linears("mixed-bf16")
    assert row["fwd_mem_bytes"] - bf16["fwd_mem_bytes"] == cast(T * A) + cast(A * B) + cast(T * B) + cast(B * C)
    assert row["bwd_mem_bytes"] - bf16["bwd_mem_bytes"] == cast(T * C) + cast(T * B)


def test_the_weights_fp8_copies_are_cached_beside_them() -> None:
    from mpsim.sim.program import static_bytes

    row = _two_linears("fp8-delayed")
    params = A * B + B * C
    from helpers import layer, tiny_trace

    trace = tiny_trace([layer("l", params=params)])
    assert static_bytes(trace.layers, 1, weight_cache_per_param=2.0)["params"] == 2 * params + 2 * params
    assert row["params"] == params


def test_an_fp8_gemm_is_timed_at_the_fp8_rate_of_the_kernel_table() -> None:
    from mpsim.api import at_recipe
    from mpsim.data.catalog import load_trace

    gpu = load_topology("dgx-h100").spec.gpu
    trace = at_recipe(load_trace("gpt2-xl"), "fp8-delayed")
    rates = kernel_rates(trace, gpu)
    assert rates is not None and rates.low is not None and rates.low.dtype == "fp8"
    kernel = GemmKernel(m=8192, n=6400, k=1600, low_precision=True)
    assert kernel_seconds(kernel, rates) == gemm_seconds(8192, 6400, 1600, 1, rates.low)
    assert kernel_seconds(kernel, rates) < kernel_seconds(kernel.model_copy(update={"low_precision": False}), rates)
    bf16 = cost_model(load_trace("gpt2-xl").rescale(trace.microbatch), gpu).layer_times
    fp8 = cost_model(trace, gpu).layer_times
    assert fp8.fwd_s[1] < bf16.fwd_s[1] and fp8.gemm_fwd_s[1] < 0.7 * bf16.gemm_fwd_s[1]


def test_a_gpu_without_fp8_tensor_cores_refuses_an_fp8_recipe_in_one_line() -> None:
    from mpsim.api import at_recipe
    from mpsim.data.catalog import load_trace

    trace = at_recipe(load_trace("gpt2-xl"), "fp8-delayed")
    with pytest.raises(MpsimError, match="runs its GEMMs in fp8, which the A100-SXM4-80GB has no tensor cores for") \
            as exc:
        cost_model(trace, load_topology("dgx-a100-80gb").spec.gpu)
    assert "\n" not in str(exc.value)


def test_a_bf16_trace_file_is_unchanged_by_the_fp8_fields() -> None:
    from mpsim.data.catalog import load_trace

    text = load_trace("llama-3-8b").to_json()
    assert "low_precision" not in text and "gemm_dtype" not in text and "quantized" not in text


def test_the_fp8_figures_in_the_readme_are_what_the_simulator_gives() -> None:
    import re
    from pathlib import Path

    from mpsim.api import at_recipe, data_parallel, plan
    from mpsim.data.catalog import load_trace

    text = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    found = re.search(r"gives ([\d.]+) ms an iteration and a ([\d.]+) GiB peak, against ([\d.]+) ms and ([\d.]+) GiB "
                      r"with `--recipe mixed-bf16` \(([\d.]+)x faster", text)
    assert found
    runs = {}
    for recipe in ("fp8-delayed", "mixed-bf16"):
        trace = at_recipe(load_trace("llama-3-8b"), recipe)
        result = plan("dgx-h100", trace, microbatch=1, microbatches=4, parallelism=data_parallel(8, 3, None)).result
        runs[recipe] = (f"{result.iteration_s * 1e3:.1f}", f"{result.gpus[0].peak_bytes / 2**30:.2f}")
    assert (found[1], found[2]) == runs["fp8-delayed"] and (found[3], found[4]) == runs["mixed-bf16"]
    assert found[5] == f"{float(runs['mixed-bf16'][0]) / float(runs['fp8-delayed'][0]):.2f}"


def test_nvfp4_needs_fp4_tensor_cores_and_says_its_times_are_an_estimate_without_fp4_kernel_data() -> None:
    from mpsim.api import at_recipe
    from mpsim.data.catalog import load_trace

    trace = at_recipe(load_trace("gpt2-xl"), "nvfp4")
    assert RECIPES["nvfp4"].quantized_bytes == 0.5 + 1 / 16
    with pytest.raises(MpsimError, match="runs its GEMMs in fp4, which the H100-SXM5-80GB has no tensor cores for"):
        cost_model(trace, load_topology("dgx-h100").spec.gpu)
    band, why = cost_model(trace, load_topology("dgx-b200").spec.gpu).time_band()
    assert band == 25.2 and "no fp4 GEMM rate" in why


@pytest.mark.parametrize(("model", "why"), [("mixtral-8x7b", "cannot be retraced under fp8-delayed"),
                                            ("no-such-recipe", "expected one of")])
def test_a_recipe_that_cannot_be_applied_is_refused_in_one_line(model: str, why: str) -> None:
    from mpsim.api import at_recipe
    from mpsim.data.catalog import load_trace

    trace = load_trace("mixtral-8x7b")
    with pytest.raises(MpsimError, match=why) as exc:
        at_recipe(trace, "fp8-delayed" if model == "mixtral-8x7b" else model)
    assert "\n" not in str(exc.value)



def test_the_head_and_the_routers_stay_in_bf16_under_fp8() -> None:
    """DeepSeek-V3 (section 3.3) and Megatron-LM keep the output head and the MoE gating in
    their original precision: a tiny Mixtral under fp8-delayed runs its attention and experts'
    GEMMs in FP8, its router's (n = the 4 experts) and its head's in bf16."""
    from pathlib import Path

    from mpsim.models.hf import trace_hf

    config = Path(__file__).resolve().parent / "data" / "tiny-mixtral.json"
    trace = trace_hf(str(config), recipe="fp8-delayed")
    moe = next(r for r in trace.layers if r.is_moe)
    gemms = [k for k in moe.fwd_kernels if isinstance(k, GemmKernel)]
    router = [k for k in gemms if k.n == moe.experts]
    assert router and not any(k.low_precision for k in router)
    assert all(k.low_precision for k in gemms if k.n != moe.experts)
    assert not any(k.low_precision for k in trace.layers[-1].fwd_kernels + trace.layers[-1].bwd_kernels
                   if isinstance(k, GemmKernel))
