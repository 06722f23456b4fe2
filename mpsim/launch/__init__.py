"""From plan to launch and back (issue 52): a job as the frameworks' own configurations
say it (``job.LaunchJob``), written and read for Megatron-LM, torchtitan, DeepSpeed and
Accelerate."""

FORMATS = ("megatron", "torchtitan", "deepspeed", "accelerate")
"""The formats, each ``mpsim.launch.<name>`` (here, so the command line names them without
importing the simulator)."""
