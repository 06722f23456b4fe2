"""Fit the shipped MPress model shapes to MPress Table II's per-stage memory.

    python benchmarks/fit_table2.py                 # every Table II row
    python benchmarks/fit_table2.py bert-6.2b --top 5

MPress (HPCA 2023) publishes, per model, the parameter count (the name) and the measured
GPU memory without memory saving (Table II: total over the 8 stages, largest and smallest
stage) but no layer count or width. Section IV-A fixes the rest: BERT "deeper and wider by
adjusting the number of encoder layers and the value of hidden sizes" under PipeDream at
microbatch 12, GPT "with adjusted parameters" under DAPPLE at microbatch 2. Sequence
length, vocabulary and precision stay as ``mpsim.models.workloads`` has them.

With the parameter count fixed, the shape decides the activation memory: a layer has
about 12*h^2 parameters and keeps about s*b*h*(34 + 5*a*s/h) bytes (fp16, eager
attention), so narrower-and-deeper, or more heads (head dimension 64 rather than 128),
keeps more per parameter. For each model this script tries every width that is a multiple
of the head dimension (64 or 128), takes the layer count whose parameter count is nearest
the name's (kept only within ``--param-tol``), traces it (FakeTensor, ``trace_model``),
simulates Table II's setting exactly as ``benchmarks/mpress_table2.py`` does, and keeps
the shape whose worse error, on the largest stage or on the total, is smallest.

Shapes are kept "sane": hidden a multiple of 128, heads of 64 or 128, and hidden/layers
between ``--min-aspect`` (10) and ``--max-aspect`` (256). Published models sit between
about 30 (GPT-2 XL: 48 x 1600) and 200 (MT-NLG 530B: 105 x 20480), and Kaplan et al.
(2020, section 3.1 and Fig. 5) find the loss depends only weakly on depth against width
over a much wider range, so a deeper-narrower fit is a plausible model, not a freak.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from mpress_table2 import TABLE_II, stage_peaks

from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ZOO, ModelConfig


@dataclass(frozen=True)
class Fit:
    cfg: ModelConfig
    total: float
    largest: float
    smallest: float
    err_total: float
    err_max: float

    @property
    def worst(self) -> float:
        return max(abs(self.err_total), abs(self.err_max))

    def line(self, name: str) -> str:
        c = self.cfg
        return (f"{name:11s} {c.layers:4d} x {c.hidden:5d} ({c.heads:3d} heads of {c.head_dim:3d})  "
                f"{c.param_count() / 1e9:6.2f}B  total {self.total:7.1f} ({100 * self.err_total:+5.1f}%)  "
                f"max {self.largest:6.1f} ({100 * self.err_max:+5.1f}%)  min {self.smallest:5.1f}")


#: Head dimensions tried per family: every Google BERT (the paper's reference [1]) has 64;
#: GPT-2 and the small GPT-3 models have 64, GPT-3 6.7B and up 128.
HEAD_DIMS = {"bert": (64,), "gpt": (64, 128)}
#: The one Table II size that is a published model keeps its shape: BERT-Large (Devlin et
#: al. 2019, the paper's reference [1]: 24 x 1024, 16 heads, 0.34B), 5% from Table II.
PUBLISHED = {"bert-0.35b"}


def target_params(name: str) -> float:
    """The parameter count a Table II name states: ``gpt-10.3b`` is 10.3e9."""
    return float(name.split("-")[1].rstrip("b")) * 1e9


def candidates(base: ModelConfig, target: float, param_tol: float, min_aspect: float,
               max_aspect: float) -> list[ModelConfig]:
    """Every (layers, hidden, heads), hidden a multiple of 128 (as Megatron-LM pads widths)
    at the family's head dimensions, with the layer count whose parameter count is nearest
    ``target``, kept when within ``param_tol`` of it and hidden/layers in the aspect range."""
    out = []
    for head_dim in HEAD_DIMS[base.family]:
        for hidden in range(512, 16385, 128):
            probe = dataclasses.replace(base, layers=1, hidden=hidden, heads=hidden // head_dim)
            fixed = probe.param_count() - probe.layer_params()
            layers = round((target - fixed) / probe.layer_params())
            if layers < 2 or not min_aspect <= hidden / layers <= max_aspect:
                continue
            cfg = dataclasses.replace(probe, layers=layers)
            if abs(cfg.param_count() / target - 1) <= param_tol:
                out.append(cfg)
    return out


def evaluate(name: str, cfg: ModelConfig) -> Fit:
    """Table II's setting for ``cfg`` under row ``name`` (as benchmarks/mpress_table2.py runs it)."""
    _, microbatch, recipe = ZOO[name]
    peaks = stage_peaks(name, trace_model(cfg, microbatch, recipe, name=name))
    total_paper, max_paper, _ = TABLE_II[name]
    return Fit(cfg, sum(peaks), max(peaks), min(peaks), sum(peaks) / total_paper - 1, max(peaks) / max_paper - 1)


def fit(name: str, param_tol: float, min_aspect: float, max_aspect: float) -> list[Fit]:
    """All candidates of ``name``, best (smallest worse error) first."""
    base = ZOO[name][0]
    fits = [evaluate(name, c) for c in candidates(base, target_params(name), param_tol, min_aspect, max_aspect)]
    return sorted(fits, key=lambda f: (f.worst, f.cfg.layers))


def fit_shared(names: list[str], param_tol: float, min_aspect: float, max_aspect: float) -> list[dict[str, Fit]]:
    """One width and head count for all of ``names`` (MPress grows GPT "with adjusted
    parameters", as GPT-3's sizes share widths), each with its own layer count: the widths
    every row admits, best (smallest worst error over the rows) first."""
    per_row = {name: {(f.cfg.hidden, f.cfg.heads): f for f in fit(name, param_tol, min_aspect, max_aspect)}
               for name in names}
    widths = set.intersection(*(set(fits) for fits in per_row.values()))
    family = [{name: per_row[name][w] for name in names} for w in widths]
    return sorted(family, key=lambda fam: (max(f.worst for f in fam.values()), fam[names[0]].cfg.hidden))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=list(TABLE_II), help="Table II rows (default: all)")
    ap.add_argument("--top", type=int, default=1, help="how many candidates to print per model (or GPT width)")
    ap.add_argument("--param-tol", type=float, default=0.03, help="parameter count tolerance (fraction)")
    ap.add_argument("--min-aspect", type=float, default=10.0, help="smallest hidden/layers")
    ap.add_argument("--max-aspect", type=float, default=256.0, help="largest hidden/layers")
    args = ap.parse_args()
    bounds = (args.param_tol, args.min_aspect, args.max_aspect)
    print("model       shape                                  params   Table II error: total, largest stage; "
          "smallest stage (GB)")
    for name in args.models:
        print(evaluate(name, ZOO[name][0]).line(name) + "   <- shipped")
    print()
    gpt = [name for name in args.models if name.startswith("gpt")]
    for name in args.models:
        if name in PUBLISHED:
            print(evaluate(name, ZOO[name][0]).line(name) + "   (published shape, kept)")
        elif not name.startswith("gpt"):
            for f in fit(name, *bounds)[: args.top]:
                print(f.line(name))
    if gpt:
        for i, fam in enumerate(fit_shared(gpt, *bounds)[: args.top]):
            print(f"GPT width #{i + 1}, worst {100 * max(f.worst for f in fam.values()):.1f}%:")
            for name, f in fam.items():
                print(f.line(name))


if __name__ == "__main__":
    main()
