"""What the training framework does at run time, named: runtime profiles.

The same layout runs at different speeds under different frameworks: one hides the
tensor-parallel collectives behind GEMMs, another launches every kernel from Python. A
``RuntimeProfile`` says, for one framework (and version), the rules the engine applies on
top of the kernels' own times:

- **Tensor-parallel communication overlap** (``tp_comm_overlap``). Without it (Megatron-LM,
  Shoeybi et al. 2019, section 3) a layer's all-reduces (or, under sequence parallelism, its
  all-gathers and reduce-scatters) run after its compute and the stream waits for them.
  With it (Megatron-Core's ``--tp-comm-overlap``, torchtitan's async TP: the GEMM is split
  into chunks pipelined with the collective that feeds or drains it) the collectives run
  while the layer's GEMMs run: they start ``gemm_s`` before the layer's compute ends, and
  only the part longer than its GEMMs stays on the critical path,
  exposed = max(0, t_collective - t_gemm) on an idle ring. Nothing hides behind attention
  or the element-wise kernels.
- **Host dispatch per kernel** (``host_dispatch_us``): an eager framework launches each
  kernel from the CPU. The host runs ahead of the GPU while kernels are long and its queue
  covers the short ones, so over a pass the stream is busy for
  max(sum of kernel times, launches x host_dispatch_us): the producer's bound on a
  consumer fed through a queue. 0: the launches hide (CUDA graphs, or kernels long enough).
- **Gradient-reduce overlap** (``grad_reduce_overlap``): DDP's and ZeRO-1's buckets are
  reduced as each is ready, beside the rest of the backward (PyTorch DDP, Megatron-Core
  with ``--overlap-grad-reduce``); off, they are all reduced after the backward, before the
  update (Megatron-Core's default DDP config, DeepSpeed's ZeRO-1). ZeRO-2 and ZeRO-3 reduce
  each microbatch's buckets as they are ready in every profile, and ZeRO-3's gathers are
  prefetched (``mpsim.sim.data_parallel``).
- **Expert-parallel communication overlap** (``ep_comm_overlap``). Without it (Megatron-Core's
  default MoE layer) each MoE layer's dispatch and combine all-to-alls run between the
  router and the experts and after them, and the stream waits for them. With it
  (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, which interleaves the forward
  of one microbatch with the backward of another so that one's all-to-alls run beside the
  other's compute; DeepSeek-V3's DualPipe, Liu et al. 2024, section 3.2.1) they run beside
  compute: modelled as for tensor parallelism, they start ``gemm_s`` before the layer's
  compute ends and only what outlasts its GEMMs is exposed (``mpsim.sim.expert_group``).

``DEFAULT_PROFILE`` is the engine's model as it was before profiles were named: the
defaults of the answers do not change until a kernel-level source says they should.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpsim.errors import MpsimError

__all__ = ["DEFAULT_PROFILE", "PROFILES", "RuntimeProfile", "dispatch_bound", "profile_named"]


@dataclass(frozen=True)
class RuntimeProfile:
    """One framework's run-time rules (module doc)."""

    name: str
    framework: str
    tp_comm_overlap: bool
    host_dispatch_us: float
    summary: str
    """One line: what it hides and what it adds, for every output that names it."""
    source: str
    grad_reduce_overlap: bool = True
    """DDP's and ZeRO-1's gradient buckets reduced as they are ready, beside the rest of the
    backward; off: all after the backward (``mpsim.sim.data_parallel``)."""
    ep_comm_overlap: bool = False
    """Mixture-of-experts dispatch and combine all-to-alls hidden behind compute as far as
    the layer's GEMMs last; off: on the critical path (``mpsim.sim.expert_group``)."""


_EAGER_DISPATCH = ("host dispatch 8 us a kernel: about 5 us of dispatcher and autograd bookkeeping per op "
                   "(pytorch/pytorch issue 41383, measured on CPU tensors, 2020) plus 3.0 us for cuLaunchKernel "
                   "(meta-pytorch/tritonbench PR 1017, GB200, 2026); a sum of two kernel-level figures, not a "
                   "profile of a training step")

PROFILES: dict[str, RuntimeProfile] = {p.name: p for p in (
    RuntimeProfile(
        "megatron-lm", "Megatron-LM", tp_comm_overlap=False, host_dispatch_us=0.0,
        summary="tensor-parallel collectives on the critical path; gradient reduction overlapped with the "
                "backward (--overlap-grad-reduce, as PyTorch DDP and FSDP do)",
        source="Shoeybi et al. 2019, section 3 (synchronous all-reduces in each layer's forward and backward); "
               "the engine's model before profiles were named"),
    RuntimeProfile(
        "megatron-lm-sync-grads", "Megatron-LM", tp_comm_overlap=False, host_dispatch_us=0.0,
        grad_reduce_overlap=False,
        summary="tensor-parallel collectives on the critical path; gradients reduced after the backward "
                "(Megatron-Core's default DDP config, without --overlap-grad-reduce)",
        source="Megatron-Core DistributedDataParallelConfig: overlap_grad_reduce defaults to False"),
    RuntimeProfile(
        "megatron-core-tp-overlap", "Megatron-Core", tp_comm_overlap=True, host_dispatch_us=0.0,
        summary="tensor-parallel collectives hidden behind their layer's GEMMs (--tp-comm-overlap)",
        source="Megatron-Core's tensor-parallel communication overlap (userbuffers: the all-gather and "
               "reduce-scatter of sequence parallelism pipelined with the GEMMs they feed and drain)"),
    RuntimeProfile(
        "torchtitan-async-tp", "torchtitan", tp_comm_overlap=True, host_dispatch_us=0.0,
        summary="tensor-parallel collectives hidden behind their layer's GEMMs (async TP, torch.compile)",
        source="torchtitan's async tensor parallelism (micro-pipelined all-gather and reduce-scatter with the "
               "matmuls, under torch.compile)"),
    RuntimeProfile(
        "megatron-core-ep-overlap", "Megatron-Core", tp_comm_overlap=False, host_dispatch_us=0.0,
        ep_comm_overlap=True,
        summary="tensor-parallel collectives on the critical path; mixture-of-experts all-to-alls hidden behind "
                "compute as far as the layer's GEMMs last (--overlap-moe-expert-parallel-comm, DualPipe-style)",
        source="Megatron-Core's MoE expert-parallel communication overlap (forward of one microbatch beside the "
               "backward of another); DeepSeek-V3 technical report (Liu et al. 2024), section 3.2.1, DualPipe"),
    RuntimeProfile(
        "eager", "PyTorch eager (DeepSpeed, FSDP without compile)", tp_comm_overlap=False, host_dispatch_us=8.0,
        summary="tensor-parallel collectives on the critical path; every kernel launched from Python, "
                "8 us of host time each",
        source=_EAGER_DISPATCH),
    RuntimeProfile(
        "deepspeed", "DeepSpeed", tp_comm_overlap=False, host_dispatch_us=8.0, grad_reduce_overlap=False,
        summary="every kernel launched from Python, 8 us of host time each; DDP and ZeRO-1 gradients reduced "
                "after the backward (overlap_comm off)",
        source=_EAGER_DISPATCH + "; gradients: DeepSpeed ZeRO-1 registered no hooks to overlap the backward with "
                                 "the gradient all-reduce and ignored overlap_comm (DeepSpeed PR 4887, 2024)"),
)}
"""Profiles by name (``--runtime``)."""

DEFAULT_PROFILE = "megatron-lm"


def profile_named(name: str) -> RuntimeProfile:
    """The profile called ``name``; a one-line refusal naming the known ones otherwise."""
    profile = PROFILES.get(name)
    if profile is None:
        raise MpsimError(f"unknown runtime profile {name!r}: use one of {', '.join(PROFILES)}")
    return profile


def dispatch_bound(pass_s: np.ndarray, launches: np.ndarray, profile: RuntimeProfile) -> np.ndarray:
    """Each pass's seconds under the profile's host dispatch (module doc):
    max(kernel seconds, launches x host_dispatch_us)."""
    if profile.host_dispatch_us <= 0:
        return pass_s
    out = np.maximum(pass_s, launches * profile.host_dispatch_us * 1e-6)
    out.setflags(write=False)
    return out
