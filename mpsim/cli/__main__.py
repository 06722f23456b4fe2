"""``python -m mpsim.cli``: the ``mpsim`` command."""

from mpsim.cli import run

if __name__ == "__main__":  # not when a worker process of `mpsim serve` imports the main module
    run()
