"""Studies: many simulations (what fits, sweeps, which server, how many servers, the papers'
comparisons, validation on real hardware) and where they run (local pool or Ray)."""
