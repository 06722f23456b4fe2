"""Every efficiency under what the best lone kernel reaches on its GPU (issue 46, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpsim.data.catalog import load_topology
from mpsim.errors import SchemaError
from mpsim.hardware.ceilings import CEILINGS, ceiling_for, check_efficiency, check_table
from mpsim.hardware.gpu_tables import SHIPPED, family_of
from mpsim.hardware.topology import parse_topology
from mpsim.timing.kernel_time import KernelRates, gemm_seconds

ROOT = Path(__file__).resolve().parent.parent
SERVERS = sorted(p.stem for p in (ROOT / "topologies").glob("*.yaml"))
MODEL_OF_FAMILY = {"hopper-sxm": "H100-SXM5-80GB", "hopper-pcie": "H100 PCIe", "ampere": "A100-SXM4-80GB",
                   "volta": "V100-SXM2-32GB", "turing": "TITAN RTX", "pascal": "GTX 1080 Ti",
                   "blackwell": "B200-GB200-186GB", "cdna3": "MI300X-OAM-192GB",
                   "blackwell-ultra": "B300-SXM6-288GB", "blackwell-geforce": "GeForce-RTX-5090-32GB",
                   "ada": "GeForce-RTX-4090-24GB", "ada-l40s": "L40S-PCIe-48GB", "cdna3-mi325x": "MI325X-OAM-256GB",
                   "cdna4": "MI355X-OAM-288GB"}


@pytest.mark.parametrize("server", SERVERS)
def test_every_shipped_efficiency_is_under_its_gpus_ceiling(server):
    gpu = load_topology(server).spec.gpu
    for dtype, eff in (gpu.efficiency or {}).items():
        assert check_efficiency(gpu.model, dtype, eff.matmul, eff.attention, eff.memory) == []
        c = ceiling_for(gpu.model, dtype)
        assert eff.matmul <= c.gemm and eff.attention <= c.attention and eff.memory <= c.memory


@pytest.mark.parametrize("family", sorted(SHIPPED))
def test_every_shipped_kernel_table_is_under_its_gpus_ceiling(family):
    model = MODEL_OF_FAMILY[family]
    assert family_of(model) == family
    assert check_table(model, SHIPPED[family]) == []


def test_hopper_ceilings_are_the_published_best_gemm_and_fa3():
    c = CEILINGS["hopper-sxm"]["bf16"]
    assert c.gemm == round(794.5 / 989, 3) and c.attention == 0.765
    assert "794.5" in c.source and "FlashAttention-3" in c.source
    fp8 = CEILINGS["hopper-sxm"]["fp8"]
    assert fp8.gemm == round(1402.6 / 1979, 3) and SHIPPED["hopper-sxm"].gemm["fp8"].fraction <= fp8.gemm


def test_no_shape_runs_an_h100_gemm_faster_than_the_best_measured_one():
    """The table's full-wave fraction at its best tile, swept over shapes, stays under the
    MAMF figure (794.5 of 989 TFLOP/s, pinned as 0.803 of peak) that bounds it."""
    gpu = load_topology("dgx-h100").spec.gpu
    table = SHIPPED["hopper-sxm"]
    rates = KernelRates(table, "bf16", 989e12, 3350e9, 2)
    best = max(2 * m * n * k / gemm_seconds(m, n, k, 1, rates) / 1e12
               for m in (4096, 8192, 16896, 33792) for n in (256, 1024, 4096, 8192) for k in (4096, 8192))
    assert best <= CEILINGS["hopper-sxm"]["bf16"].gemm * 989 + 1e-6  # 0.803 of peak
    assert gpu.kernel_table() is table  # auto: kernel data of this GPU, so on by default


def test_the_old_h100_fit_is_refused_in_one_line():
    """The bf16 matmul efficiency 0.945 that mpsim calibrate once fitted to our H100 layers is
    above every lone GEMM on that GPU: a file carrying it is refused, naming the ceiling."""
    spec = load_topology("dgx-h100").spec.model_dump(by_alias=True, exclude_none=True)
    spec["gpu"]["efficiency"]["bf16"]["matmul"] = 0.945
    with pytest.raises(SchemaError) as err:
        parse_topology(spec, "old-h100.yaml")
    line = str(err.value)
    assert "\n" not in line and "bf16.matmul 0.945 is above 0.803" in line and "794.5" in line


def test_transferred_tables_stay_opt_in_and_kernel_data_tables_are_on():
    """Tables whose GEMM figures come from kernel benchmarks of their GPU time layers by
    default (H100/H200, A100, B200/GB200, B300/GB300, RTX 4090, RTX 5090, MI300X, MI325X, MI355X);
    Volta, Turing, Pascal and the L40S (transferred from the RTX 4090) keep the roofline."""
    on = {f for f, t in SHIPPED.items() if t.by_default}
    assert on == {"hopper-sxm", "hopper-pcie", "ampere", "blackwell", "cdna3", "blackwell-ultra", "blackwell-geforce",
                  "ada", "cdna3-mi325x", "cdna4"}
    assert load_topology("l40s-x8-pcie").spec.gpu.kernel_table() is None
    assert load_topology("gb200-nvl72").spec.gpu.kernel_table() is SHIPPED["blackwell"]
    assert load_topology("mi300x-x8").spec.gpu.kernel_table() is SHIPPED["cdna3"]
    assert load_topology("dgx1-v100").spec.gpu.kernel_table() is None
    assert load_topology("dgx-a100-80gb").spec.gpu.kernel_table() is SHIPPED["ampere"]
