"""The job and its plan: the parallel layout as a device mesh, the job type checked once, layout
names and the layouts searched, schedules, partitions, plan files and the strategy registry."""

from mpsim.plans import context_parallel as context_parallel  # registers the context axis (cp4)
from mpsim.plans import expert as expert  # registers the expert axis (ep8) before any layout is read
