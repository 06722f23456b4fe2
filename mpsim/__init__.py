"""mpsim: will this model train on this server, with which memory plan, and how fast?

    from mpsim import load_topology, load_trace, simulate, fits
"""

from mpsim.api import load_topology, load_trace, simulate
from mpsim.capacity import fits
from mpsim.errors import MpsimError, SchemaError

__all__ = ["MpsimError", "SchemaError", "fits", "load_topology", "load_trace", "simulate"]
__version__ = "0.1.0"
