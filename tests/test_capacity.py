"""What fits: the table for the shipped sizes and the largest size found by the search."""

from mpsim import fits, load_trace, simulate
from mpsim.cli import main


def test_gpt_on_dgx1_only_the_smallest_shipped_size_fits_as_in_mpress():
    # MPress IV-C: DAPPLE cannot scale GPT beyond 5.3B on the DGX-1 without memory savings.
    rep = fits("dgx1-v100", "gpt", "1f1b", 2, 16)
    assert [r.result.fits for r in rep.rows] == [True, False, False, False, False]


def test_largest_is_the_boundary_of_the_layer_search():
    rep = fits("dgx1-v100", "gpt", "1f1b", 2, 16)
    assert rep.largest is not None
    n = rep.largest.layers
    template = load_trace(rep.largest_template)
    assert simulate("dgx1-v100", template.with_layers(n), "1f1b", 2, 16).fits
    assert not simulate("dgx1-v100", template.with_layers(n + 1), "1f1b", 2, 16).fits


def test_search_goes_down_when_no_shipped_size_fits():
    # 4 x 24 GB TITAN RTX: even GPT-5.3B (29 layers) is too big; fewer layers of its shape fit.
    rep = fits("titanrtx-x4-pcie", "gpt", "1f1b", 2, 16)
    assert not any(r.result.fits for r in rep.rows)
    assert rep.largest is not None
    n = rep.largest.layers
    assert 1 <= n < 29 and rep.largest.result.fits
    template = load_trace(rep.largest_template)
    assert not simulate("titanrtx-x4-pcie", template.with_layers(n + 1), "1f1b", 2, 16).fits


def test_nothing_fits_is_reported_as_none():
    # One 11 GB GPU cannot hold even one 3840-wide GPT layer, with the embedding, head and
    # their Adam states, at microbatch 4.
    rep = fits("gtx1080ti-x1", "gpt", "gpipe", 4, 1)
    assert rep.largest is None and rep.to_dict()["largest"] is None


def test_trace_command_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    code = main(["trace", "--family", "bert", "--layers", "2", "--hidden", "128", "--heads", "2", "--seq-len", "64",
                 "--vocab", "500", "--microbatch", "4", "-o", str(out)])
    assert code == 0 and "wrote" in capsys.readouterr().out
    t = load_trace(str(out))
    assert t.n_layers == 4 and t.microbatch == 4 and t.spec.source.kind == "derived"
    assert simulate("titanrtx-x1", t, "gpipe", None, 2).fits


def test_best_search_leaves_out_planners_known_not_to_fit_and_finds_the_same_largest(monkeypatch):
    """``fits`` under ``best`` skips, in its search's probes, the single planners whose own
    searches showed they do not fit there (a failed shipped size, or one layer past their
    largest); the largest it finds and its plan are those of the full search."""
    import mpsim.planners.best as best
    from mpsim.planners.cache import _CACHE
    from mpsim.studies.capacity import _known_failing, fits_strategies

    job = ("gtx1080ti-x1", "gpt", "1f1b", 2, 4)
    singles = fits_strategies(*job, strategies=("none", "recompute", "tsplit"))
    failing = _known_failing(singles)
    template = singles[0].largest_template
    none_bound = failing[(template, "none", "compute")]
    largest_none = singles[0].largest
    assert largest_none is not None and none_bound == largest_none.layers + 1
    assert all(failing[(r.model, "none", "compute")] <= r.layers for r in singles[0].rows if not r.result.fits)

    asked: list[tuple[str, str, int]] = []
    real = best.cached_plan

    def counting(name, ctx, planner):
        asked.append((name, ctx.partition, sum(r.kind == "transformer" for r in ctx.trace.layers)))
        return real(name, ctx, planner)

    monkeypatch.setattr(best, "cached_plan", counting)
    _CACHE.clear()
    skipping = fits(*job, strategy="best", known_failing=failing)
    skipped_asks = list(asked)
    _CACHE.clear()
    full = fits(*job, strategy="best")
    assert skipping.largest is not None and full.largest is not None
    assert skipping.largest_template == full.largest_template == template
    assert skipping.largest.layers == full.largest.layers
    assert skipping.largest.result.strategy == full.largest.result.strategy
    assert skipping.largest.result.iteration_s == full.largest.result.iteration_s
    probed = {n for _, _, n in skipped_asks} - {r.layers for r in full.rows}  # the search's, not the shipped sizes
    above = [n for name, part, n in skipped_asks if name == "none" and part == "compute" and n in probed
             and n >= none_bound]
    assert probed and not above
    assert len(skipped_asks) < len(asked) - len(skipped_asks)


def test_a_search_from_a_known_fitting_size_probes_one_layer_more_first(monkeypatch):
    """Given the most layers known to fit (``best`` gets the single planners' largest), the
    search probes one layer more first: where that does not fit, it has found the largest
    with that one probe and the plan of the largest; it finds what a search from the
    shipped sizes finds, from below and from above the boundary."""
    import mpsim.studies.capacity as capacity

    job = ("dgx1-v100", "gpt", "1f1b", 2, 16)
    full = fits(*job, strategy="none")
    assert full.largest is not None
    template, n = full.largest_template, full.largest.layers
    asked: list[int] = []

    def counting(real):
        def counted(job, *args, **kwargs):
            asked.append(sum(r.kind == "transformer" for r in job.trace.layers))
            return real(job, *args, **kwargs)
        return counted

    monkeypatch.setattr(capacity, "plan_job", counting(capacity.plan_job))
    monkeypatch.setattr(capacity, "plan_fits", counting(capacity.plan_fits))  # probes answered by existence
    for hint, most_probes in ((n, 2), (n - 3, 5)):
        asked.clear()
        hinted = fits(*job, strategy="none", known_fitting={template: hint}, rows=full.rows)
        assert hinted.largest is not None and hinted.largest.layers == n
        assert hinted.largest.result.iteration_s == full.largest.result.iteration_s
        assert asked[0] == hint + 1 and len(set(asked)) <= most_probes and n + 1 in asked


def test_fits_best_combines_the_planners_that_keep_states_on_the_gpus(capsys):
    """``fits``'s best leaves the offload strategies (best's fallback) to their own columns
    (``capacity.ON_GPU_ONLY``): where only ZeRO-Offload fits, best's cell is OOM beside it,
    and the README's fits keeps its table and its time."""
    from mpsim.cli import main

    code = main(["fits", "--server", "titanrtx-x1", "--model", "gpt-10.3b", "--microbatch", "1", "--no-largest",
                 "--strategy", "best,zero-offload"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gpt-10.3b"))
    assert code == 0 and row.split()[2:] == ["OOM", "41.24G", "0.382/s"]
