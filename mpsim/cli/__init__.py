"""The ``mpsim`` command: thin subcommands over :mod:`mpsim.api`, shown by :mod:`mpsim.views`.

Every subcommand prints a readable table, writes ``--json FILE`` (``-`` for standard
output) on request, and ends bad input with one line on standard error and exit code 2.
A command imports its views when it runs, and the facade imports what it hands out on
first use, so ``mpsim --help`` loads neither the simulator nor matplotlib.
"""

from __future__ import annotations

import sys

import click

from mpsim.cli.engine_cmd import engine
from mpsim.cli.job_cmds import plan_cmd, simulate, validate_cmd
from mpsim.cli.options import STRATEGY_HELP as _STRATEGY_HELP  # noqa: F401  (tests read the help here)
from mpsim.cli.serve_cmd import serve
from mpsim.cli.study_cmds import calibrate_cmd, choose_cmd, fits, reproduce_cmd, sweep_cmd
from mpsim.cli.topo_cmds import topo
from mpsim.cli.trace_cmd import trace
from mpsim.errors import MpsimError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="mpsim")
def app() -> None:
    """Will this model train on this server, with which memory plan, and how fast?

    mpsim simulates pipeline-parallel training (GPipe, 1F1B, PipeDream) of a traced model
    on a multi-GPU server described by a topology file, and reports per-GPU peak memory,
    iteration time and throughput.

    \b
    Examples:
      mpsim fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2
      mpsim simulate --server dgx1-v100 --model gpt-5.3b --microbatches 16 --json out.json
      mpsim simulate --server dgx-a100-80gb --model llama-2-7b
      mpsim choose --model llama-3-8b --servers dgx-a100-80gb,dgx-h100
      mpsim trace --hf llama-3-70b -o llama.json
      mpsim topo show dgx1-v100
    """


for command in (simulate, plan_cmd, fits, reproduce_cmd, sweep_cmd, trace, topo, validate_cmd, calibrate_cmd,
                choose_cmd, serve, engine):
    app.add_command(command)


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and turns every expected error into one line and exit 2."""
    try:
        app.main(args=argv, prog_name="mpsim", standalone_mode=False)
    except MpsimError as exc:
        click.echo(f"mpsim: error: {exc}", err=True)
        return 2
    except OSError as exc:  # an output path that cannot be written
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"mpsim: error: {where}cannot write ({exc.strerror or exc})", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("mpsim: aborted", err=True)
        return 130
    except click.ClickException as exc:
        click.echo(f"mpsim: error: {exc.format_message()}", err=True)
        return 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def run() -> None:
    """Console-script wrapper: exit with ``main``'s code."""
    sys.exit(main())
