"""mpsim: will this model train on this server, with which memory plan, and how fast?

    from mpsim import load_topology, load_trace, simulate, fits

These four come from :mod:`mpsim.api` when first used, so ``import mpsim.<module>`` loads
only that module and what it imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpsim.errors import MpsimError, SchemaError

if TYPE_CHECKING:
    from mpsim.api import fits, load_topology, load_trace, simulate

__all__ = ["MpsimError", "SchemaError", "fits", "load_topology", "load_trace", "simulate"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mpsim import api

    return getattr(api, name)
