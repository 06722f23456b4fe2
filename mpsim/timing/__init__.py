"""Seconds: the cost model (a trace's layer times on a GPU), kernel-level times, and the
calibration of efficiencies and kernel tables from measured traces."""
