"""The importable front door, and the one entry the command line and the web page call:
load servers and models, plan and simulate one job, run the studies, trace models, look
at servers. Each function returns data; :mod:`mpsim.views` shows it.

>>> from mpsim import simulate
>>> r = simulate("dgx1-v100", "gpt-10.3b", schedule="1f1b", microbatch=2, strategy="cpu-swap")
>>> r.fits, round(r.iteration_s, 2)

A name is imported from its module when it is first used (``__getattr__``), so importing
this, or ``mpsim``, costs nothing until something runs: ``mpsim --help`` loads no
simulator, and torch is imported only by what traces, measures, probes or validates.
"""

# ruff: noqa: F401  (the imports under TYPE_CHECKING are this module's names, handed out by __getattr__)

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what __getattr__ hands out, for type checkers and readers
    from mpsim.api.jobs import load_job, measured_warning, plan, simulate, validate
    from mpsim.api.launch import format_of, launch_of, parse_emits, pick_launch, simulate_from, write_emits
    from mpsim.api.models import (
        DEFAULT_PRESET,
        Measure,
        at_finetune,
        at_recipe,
        at_seq_len,
        check_hf,
        default_attention,
        hf_config,
        model_config,
        presets,
        retraced,
        trace_hf,
        trace_module,
        trace_shape,
    )
    from mpsim.api.servers import collective, probe_server, shipped_servers, transfer
    from mpsim.api.studies import FitsRequest, fine_tuned_files, fits_request, reproduce, sweep_warnings
    from mpsim.data.catalog import (
        is_cluster,
        load_cluster,
        load_topology,
        load_trace,
        shipped_clusters,
        shipped_topologies,
        shipped_traces,
    )
    from mpsim.hardware.cluster import DEFAULT_BATCH_TOKENS, DEFAULT_CLUSTERS
    from mpsim.hardware.topology import Topology, read_topology_file
    from mpsim.launch import FORMATS
    from mpsim.launch.formats import Where
    from mpsim.limits import DEFAULT_HEADROOM_GIB, MAX_HEADROOM_GIB
    from mpsim.models.expert_parallel import UNIFORM, ExpertLoad, parse_expert_load
    from mpsim.models.finetune import FineTune, fine_tune_of
    from mpsim.models.trace import RECIPE_HELP, RECIPES, Trace, read_trace_file
    from mpsim.native import EngineState, engine_status
    from mpsim.native_build import BuildInterrupted, BuildReport, build_engine, remove_engine
    from mpsim.planners import Planned, plan_job
    from mpsim.plans.job import (
        DEFAULT_MICROBATCHES,
        DEFAULT_MODEL,
        DEFAULT_SCHEDULE,
        DEFAULT_SERVER,
        PARTITIONS,
        JobSpec,
        Parallelism,
        data_parallel,
        job_of,
    )
    from mpsim.plans.layouts import CHOOSE_LAYOUTS, DEFAULT_LAYOUTS, LAYOUTS_HELP, candidate_layouts, parse_layout
    from mpsim.plans.plan import PlanFile, read_plan_file, write_plan_file
    from mpsim.plans.strategies import STRATEGIES, STRATEGY_HELP, check_zero_stage, planner_runs
    from mpsim.sim import SimResult
    from mpsim.sim.progress import reporting
    from mpsim.studies.backends import backend_for, make_backend
    from mpsim.studies.capacity import FitsReport, LayoutFits, fits
    from mpsim.studies.choose import ChooseReport, choose, parse_price, parse_servers
    from mpsim.studies.scale import ScaleReport, scale, search_work
    from mpsim.studies.sweep import Point, SweepInterrupted, grid, sweep
    from mpsim.timing.calibrate import Calibration, calibrate, calibrated_yaml
    from mpsim.timing.calibrate_kernels import calibrate_profile_file, kernel_table_yaml
    from mpsim.timing.runtime import DEFAULT_PROFILE, PROFILES

#: Where each name lives (the same imports as above, made on first use).
_HOMES: dict[str, tuple[str, ...]] = {
    "mpsim.api.jobs": ("load_job", "measured_warning", "plan", "simulate", "validate"),
    "mpsim.api.launch": ("format_of", "launch_of", "parse_emits", "pick_launch", "simulate_from", "write_emits"),
    "mpsim.launch": ("FORMATS",),
    "mpsim.launch.formats": ("Where",),
    "mpsim.api.models": ("DEFAULT_PRESET", "Measure", "at_finetune", "at_recipe", "at_seq_len", "check_hf",
                         "default_attention", "hf_config", "model_config", "presets", "retraced", "trace_hf",
                         "trace_module",
                         "trace_shape"),
    "mpsim.api.servers": ("collective", "probe_server", "shipped_servers", "transfer"),
    "mpsim.api.studies": ("FitsRequest", "fine_tuned_files", "fits_request", "reproduce", "sweep_warnings"),
    "mpsim.studies.backends": ("backend_for", "make_backend"),
    "mpsim.timing.calibrate": ("Calibration", "calibrate", "calibrated_yaml"),
    "mpsim.timing.calibrate_kernels": ("calibrate_profile_file", "kernel_table_yaml"),
    "mpsim.timing.runtime": ("DEFAULT_PROFILE", "PROFILES"),
    "mpsim.studies.capacity": ("FitsReport", "LayoutFits", "fits"),
    "mpsim.data.catalog": ("is_cluster", "load_cluster", "load_topology", "load_trace", "shipped_clusters",
                      "shipped_topologies", "shipped_traces"),
    "mpsim.studies.choose": ("ChooseReport", "choose", "parse_price", "parse_servers"),
    "mpsim.plans.job": ("DEFAULT_MICROBATCHES", "DEFAULT_MODEL", "DEFAULT_SCHEDULE", "DEFAULT_SERVER", "JobSpec",
                  "PARTITIONS", "Parallelism", "data_parallel", "job_of"),
    "mpsim.limits": ("DEFAULT_HEADROOM_GIB", "MAX_HEADROOM_GIB"),
    "mpsim.plans.layouts": ("CHOOSE_LAYOUTS", "DEFAULT_LAYOUTS", "LAYOUTS_HELP", "candidate_layouts", "parse_layout"),
    "mpsim.native": ("EngineState", "engine_status"),
    "mpsim.native_build": ("BuildInterrupted", "BuildReport", "build_engine", "remove_engine"),
    "mpsim.plans.plan": ("PlanFile", "read_plan_file", "write_plan_file"),
    "mpsim.planners": ("Planned", "plan_job"),
    "mpsim.hardware.cluster": ("DEFAULT_BATCH_TOKENS", "DEFAULT_CLUSTERS"),
    "mpsim.studies.scale": ("ScaleReport", "scale", "search_work"),
    "mpsim.sim": ("SimResult",),
    "mpsim.sim.progress": ("reporting",),
    "mpsim.plans.strategies": ("STRATEGIES", "STRATEGY_HELP", "check_zero_stage", "planner_runs"),
    "mpsim.studies.sweep": ("Point", "SweepInterrupted", "grid", "sweep"),
    "mpsim.hardware.topology": ("Topology", "read_topology_file"),
    "mpsim.models.trace": ("RECIPE_HELP", "RECIPES", "Trace", "read_trace_file"),
    "mpsim.models.expert_parallel": ("UNIFORM", "ExpertLoad", "parse_expert_load"),
    "mpsim.models.finetune": ("FineTune", "fine_tune_of"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next use is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
