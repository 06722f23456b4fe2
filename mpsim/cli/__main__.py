"""``python -m mpsim.cli``: the ``mpsim`` command."""

from mpsim.cli import run

run()
