"""``engine``: build, show and remove the simulator's compiled engine (``mpsim.native``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from mpsim import api
from mpsim.cli.options import emit, json_option

if TYPE_CHECKING:
    from mpsim.api import EngineState


@click.group()
def engine() -> None:
    """The compiled engine: the simulator's hottest modules compiled to C.

    \b
    `mpsim engine build` compiles them with mypyc, in seconds; it needs
    `pip install 'mpsim[native]'` and a C compiler. Every later run loads the build as
    long as mpsim's sources are those it was built from: the same results, bit for bit,
    in less time (README, Speed). After mpsim is edited or upgraded, runs use the Python
    engine again until the next build.

    \b
    Environment:
      MPSIM_ENGINE     auto (default): the build when it matches, else Python;
                       python: never the build; compiled: the build or an error
      MPSIM_CACHE_DIR  where builds live (default ~/.cache/mpsim)
    """


def _status_data(state: EngineState) -> dict:
    manifest = state.manifest
    return {"engine": "compiled" if state.in_use else "python", "mode": state.mode, "build_dir": str(state.build_dir),
            "modules": list(state.compiled), "reason": state.reason, "built": manifest.get("built"),
            "opt_level": manifest.get("opt_level")}


@engine.command("status")
@json_option
def engine_status(json_out: str | None) -> None:
    """Which engine a run would use now, and why."""
    state = api.engine_status()
    lines = [f"engine:    {state.describe()}", f"mode:      MPSIM_ENGINE={state.mode}",
             f"build dir: {state.build_dir}"]
    if state.manifest.get("built"):
        lines.append(f"built:     {state.manifest['built']} (mypyc opt level {state.manifest.get('opt_level')})")
    emit(json_out, "\n".join(lines), _status_data(state))


@engine.command("build")
@json_option
def engine_build(json_out: str | None) -> None:
    """Compile the engine for this Python and these sources (replaces the last build
    once the new one is complete)."""
    click.echo("compiling the engine with mypyc ...", err=True)
    try:
        report = api.build_engine()
    except api.BuildInterrupted as exc:  # one line, and the shell's code for the signal (130, 143)
        click.echo(f"mpsim: {exc}", err=True)
        sys.exit(exc.exit_code)
    state = api.engine_status()
    text = (f"built {len(report.modules)} modules in {report.seconds:.0f} s into {report.build_dir}\n"
            f"engine:    {state.describe()}")
    emit(json_out, text, {"seconds": round(report.seconds, 1), **_status_data(state)})


@engine.command("clean")
def engine_clean() -> None:
    """Remove the build: runs use the Python engine."""
    where, removed = api.remove_engine()
    click.echo(f"removed {where}" if removed else f"no build in {where}")
