"""Context parallelism in the executor (plan schema 4, mesh ``context``): ring attention on gloo.

``mpsim validate --model M --cp c [--dp d] --stages 1`` runs the model here, one process per
GPU of the (d, c) mesh, context innermost (Megatron-Core's order: tensor, context, expert,
data, pipeline): rank ``r`` is context-parallel rank ``i = r % c`` of data-parallel index
``r // c``, on GPU ``data_parallel.replicas[r][0]``. ``mpsim.studies.cp_check`` refuses
what this worker cannot run and starts it.

What each rank holds and does (what ``mpsim.models.context_parallel`` simulates):

- the whole model (the same seed on every rank, so the weights one GPU would have: the
  same ``Embedding``, ``TransformerLayer`` and ``LossHead`` of ``mpsim.models.workloads``
  the trace measured, built in the same order);
- 1/c of every sequence of its data-parallel index's tokens, load-balanced for the causal
  mask (Megatron-Core's ``get_batch_on_this_cp_rank``; Llama 3, Dubey et al. 2024, section
  3.3.2): the sequence of length s is cut into 2c chunks of s/2c tokens and rank i holds
  chunks i and 2c-1-i, in that order, so every rank has the same share of the causal
  mask's work. Every position-wise layer (embedding, norms, projections, MLP, head) runs
  on those s/c tokens alone; the positions are the tokens' global ones (``chunk_positions``:
  the GPT's learned positions, Llama's RoPE angles);
- attention: ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers";
  Megatron-Core's context parallelism as Transformer Engine's ``AttnFuncWithCPAndKVP2P``
  runs it). Each rank keeps its queries; the key/value blocks travel around the ring of
  the c ranks of its data-parallel index, c steps, each rank sending the block it holds to
  the next rank (``dist.isend``/``dist.irecv``, gloo) while it computes with it. Step 0 is
  the rank's own block under the causal mask; at step t the block comes from rank
  j = (i - t) mod c, and with the load-balanced chunks no later step needs a mask: for
  j < i all local queries see the block's first chunk only, for j > i only the local
  second chunk's queries see the block, both its chunks. Each block's output is merged
  into the running one by its log-sum-exp (the blockwise softmax of Milakov and
  Gimelshein 2018 and FlashAttention: out = sum_b exp(lse_b - lse) out_b). Each block runs
  mpsim's fused attention kernel (``torch.ops.mpsim.fused_attention``, the one the trace
  measured for ``flash`` and ``mem-efficient``). The rank keeps what one fused kernel keeps
  for its backward: its q, k, v, the merged output and the fp32 log-sum-exp
  (``RingAttention``);
- backward (``RingAttention.backward``, as Transformer Engine's): the key/value blocks
  travel around the ring again, each with the gradient of its keys and values
  accumulated so far (dK, dV); at each step the rank adds its queries' share (FlashAttention
  -2's backward of the block, ``torch.ops.mpsim.fused_attention_backward``, with the
  merged output and log-sum-exp, which makes the blocks' gradients exact) and sends the
  pair on; after the c-th step each dK, dV has been through every rank and one more hop
  brings it to its owner. The next block's keys and values, and the previous block's
  dK, dV, move while the rank computes;
- the loss: each rank's token losses summed and divided by the microbatch's b s tokens,
  so the c ranks' losses add up to the unsplit model's mean (the recorded loss is that
  sum, all-reduced over the context group); gradients: summed over the whole (d, c) mesh
  (the context ranks share the weights and each holds a part of every sequence's
  gradient) and divided by d, after the step's last microbatch, as DDP does; Adam (fp32,
  not foreach) on the rank's whole parameters.

The microbatches run one after another, forward then backward (1F1B on one stage). Peak
memory, step times and the rank's results go through the executor's shared epilogue
(``executor.train_and_record``: MemTracker on CPU, ``rank<i>.json``). Each rank also
records a fingerprint of the first step's reduced gradients (``gradient_fingerprint``), so
the run can be held against the unsplit model's (``unsplit_run``: one process, the whole
sequences, the same seed, tokens and steps), loss by loss and gradient by gradient.

Runs GPT and Llama (megatron framework: RoPE tables built in every layer) with the
``flash`` or ``mem-efficient`` attention backend, fp32; dropout, where the model has it,
is drawn per rank, so only a model without dropout trains exactly as the unsplit one.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mpsim.executor.executor import LR, Stepper, init_process, replica_tokens, train_and_record
from mpsim.models import kernels
from mpsim.models.workloads import Embedding, LossHead, ModelConfig, SelfAttention, TransformerLayer, _rotate_half_split
from mpsim.plans.plan import PlanFile

KV_TAG = 1
"""gloo tag of the key/value blocks' messages."""
GRAD_TAG = 2
"""gloo tag of the dK, dV messages (the same shape as the key/value blocks')."""


# --- the layout ----------------------------------------------------------------------------------


def chunk_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The global positions of context rank ``cp_rank``'s tokens: chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank`` of the sequence cut into ``2 cp`` chunks (module doc)."""
    n = seq_len // (2 * cp)
    first, second = cp_rank * n, (2 * cp - 1 - cp_rank) * n
    return torch.cat((torch.arange(first, first + n), torch.arange(second, second + n)))


def local_part(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """``x``'s two chunks of context rank ``cp_rank`` along ``dim`` (the sequence), in order."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]), dim=dim)


@dataclass(frozen=True)
class ContextRing:
    """This rank's place in its context group's ring: its context rank, the group's size,
    and the global ranks it sends to (the next) and receives from (the previous)."""

    size: int
    rank: int
    send_to: int
    recv_from: int
    group: dist.ProcessGroup | None

    @staticmethod
    def of(group_ranks: list[int], cp_rank: int, group: dist.ProcessGroup | None) -> ContextRing:
        c = len(group_ranks)
        return ContextRing(c, cp_rank, group_ranks[(cp_rank + 1) % c], group_ranks[(cp_rank - 1) % c], group)

    def block(self, step: int, half: int) -> tuple[slice, slice, bool]:
        """(local query rows, key rows of the block, causal) of ring step ``step``, the
        rank's chunks ``half`` tokens each (module doc)."""
        if step == 0:
            return slice(None), slice(None), True
        source = (self.rank - step) % self.size
        if source < self.rank:
            return slice(None), slice(0, half), False
        return slice(half, None), slice(None), False

    def shift(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        """``send`` to the next rank and a block of its shape from the previous one, started
        (``finish`` waits): the received tensor and the requests."""
        received = torch.empty_like(send)
        reqs = [dist.isend(send, self.send_to, group=self.group, tag=tag),
                dist.irecv(received, self.recv_from, group=self.group, tag=tag)]
        return received, reqs


def finish(reqs: list[Any]) -> None:
    """Wait for point-to-point requests (``ContextRing.shift``)."""
    for r in reqs:
        r.wait()


# --- ring attention ------------------------------------------------------------------------------


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the fused kernel: its output and fp32 log-sum-exp (b, a, rows)."""
    out, lse = torch.ops.mpsim.fused_attention(q, k, v, causal, scale, 1)
    return out, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
           rows: slice) -> None:
    """Merge a block's output into the running one over query rows ``rows``, in place, by
    their log-sum-exps: the softmax over both blocks' keys."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    merged = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)
              + block_out * torch.exp(block_lse - new).unsqueeze(-1))
    out[..., rows, :] = merged.to(out.dtype)
    lse[..., rows] = new


def _padded(lse: torch.Tensor, lse_rows: int) -> torch.Tensor:
    """The log-sum-exp padded to a multiple of ``lse_rows`` query rows, as the kernel keeps it."""
    rows = lse.shape[-1]
    return torch.nn.functional.pad(lse, (0, math.ceil(rows / lse_rows) * lse_rows - rows))


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (b, a, s/c, d) over every rank's keys and
    values (b, kv heads, s/c, d) of the context group, the chunks load-balanced; ring
    forward and backward as the module doc says."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: ContextRing, scale: float,
                lse_rows: int) -> torch.Tensor:
        half = q.shape[2] // 2
        kv = torch.stack((k, v))
        out = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        for step in range(ring.size):
            pending: list[Any] = []
            if step + 1 < ring.size:
                incoming, pending = ring.shift(kv, KV_TAG)
            rows, keys, causal = ring.block(step, half)
            block_out, block_lse = _block_attention(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal, scale)
            if step == 0:
                out.copy_(block_out)
                lse.copy_(block_lse)
            else:
                _merge(out, lse, block_out, block_lse, rows)
            del block_out, block_lse
            finish(pending)
            if pending:
                kv = incoming
        ctx.ring, ctx.scale = ring, scale
        ctx.save_for_backward(q, k, v, out, _padded(lse, lse_rows))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ring: ContextRing = ctx.ring
        q, k, v, out, lse = ctx.saved_tensors
        half, rows_all = q.shape[2] // 2, q.shape[2]
        lse = lse[..., :rows_all]
        grad = grad.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack((k, v))
        dkv_in: torch.Tensor | None = None  # the held block's dK, dV from the ranks before
        grad_reqs: list[Any] = []
        for step in range(ring.size):
            kv_reqs: list[Any] = []
            if step + 1 < ring.size:
                incoming, kv_reqs = ring.shift(kv, KV_TAG)
            rows, keys, causal = ring.block(step, half)
            dq_b, dk_b, dv_b = torch.ops.mpsim.fused_attention_backward(
                grad[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out[:, :, rows],
                lse[..., rows], causal, ctx.scale)
            dq[:, :, rows] += dq_b
            finish(grad_reqs)
            dkv = dkv_in if dkv_in is not None else torch.zeros_like(kv)
            dkv[0][:, :, keys] += dk_b
            dkv[1][:, :, keys] += dv_b
            del dq_b, dk_b, dv_b
            if ring.size > 1:  # on to the next rank; after the last step, to the block's owner
                dkv_in, grad_reqs = ring.shift(dkv, GRAD_TAG)
            else:
                dkv_in = dkv
            finish(kv_reqs)
            if kv_reqs:
                kv = incoming
        finish(grad_reqs)
        assert dkv_in is not None
        return dq, dkv_in[0], dkv_in[1], None, None, None


# --- the model -----------------------------------------------------------------------------------


class ContextEmbedding(Embedding):
    """``workloads.Embedding`` on this rank's tokens, the learned positions (GPT) looked up
    at their global positions."""

    def __init__(self, cfg: ModelConfig, positions: torch.Tensor) -> None:
        super().__init__(cfg)
        self.positions = positions

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word(tokens)
        if self.position is not None:
            x = x + self.position(self.positions.to(tokens.device))
        return kernels.dropout(x, self.p, self.training)


class RingSelfAttention(SelfAttention):
    """``workloads.SelfAttention`` whose core is ``RingAttention`` over the context group and
    whose RoPE (Llama, megatron framework: tables built in every layer) rotates by the
    tokens' global positions."""

    def __init__(self, cfg: ModelConfig, ring: ContextRing, positions: torch.Tensor) -> None:
        super().__init__(cfg, causal=True)
        self.ring = ring
        self.positions = positions

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.family != "llama":
            return x
        d = x.shape[-1]
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
        angles = torch.outer(self.positions.to(x.device, torch.float32), inv_freq)
        cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(x.dtype) for f in (torch.cos, torch.sin))
        return _rotate_half_split(x, cos, sin)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        return RingAttention.apply(q, k, v, self.ring, scale, kernels._LSE_ROWS[self.cfg.attention])


def _ring_attention_of(layer: TransformerLayer, ring: ContextRing, positions: torch.Tensor) -> None:
    """Swap ``layer``'s attention for a ``RingSelfAttention`` with the same weights (built
    under a forked RNG, so the weights of later layers are drawn as without it)."""
    with torch.random.fork_rng(devices=[]):
        ring_attn = RingSelfAttention(layer.cfg, ring, positions)
    ring_attn.load_state_dict(layer.attn.state_dict())
    layer.attn = ring_attn


class ContextModel(nn.Module):
    """The whole model as one stage on this rank's s/c tokens: its tokens and labels to its
    share of the microbatch's loss (its token losses over the microbatch's b s tokens)."""

    def __init__(self, cfg: ModelConfig, ring: ContextRing, positions: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.cp = ring.size
        self.embed = ContextEmbedding(cfg, positions)
        layers = [TransformerLayer(cfg) for _ in range(cfg.layers)]
        self.layers = nn.ModuleList(layers)
        self.head = LossHead(cfg)
        for layer in layers:
            _ring_attention_of(layer, ring, positions)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, labels) / self.cp  # each rank holds s/c of the b s tokens


# --- a step --------------------------------------------------------------------------------------


def gradient_fingerprint(module: nn.Module) -> dict[str, list[float]]:
    """Per parameter, its gradient's norm and its projection on a fixed random direction
    (seeded by the parameter's index): enough to hold two runs' gradients against each
    other without writing them out."""
    prints: dict[str, list[float]] = {}
    for i, (name, p) in enumerate(module.named_parameters()):
        if p.grad is None:
            continue
        g = p.grad.detach().double()
        direction = torch.randn(g.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        prints[name] = [float(g.norm()), float((g * direction.to(g.device)).sum())]
    return prints


@dataclass(frozen=True)
class ContextGroups:
    """This rank's groups: the ring of its context group, its data-parallel index, the
    number of data-parallel indices, and the context group (for the loss)."""

    ring: ContextRing
    dp_rank: int
    dp: int
    cp_group: dist.ProcessGroup | None


def make_groups(cp: int, device: torch.device) -> ContextGroups:
    """The (dp, cp) mesh over the world, context innermost; every rank creates it in one order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // cp
    group: dist.ProcessGroup | None = None
    if cp > 1:
        mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        group = mesh["cp"].get_group()
    members = [(rank // cp) * cp + j for j in range(cp)]
    return ContextGroups(ContextRing.of(members, rank % cp, group), rank // cp, dp, group)


class ContextStepper(Stepper):
    """One training step: each microbatch forward and backward on the rank's chunks
    (gradients accumulated, the loss scaled by 1/m), the gradients summed over the mesh
    and divided by the data-parallel degree, Adam's step. Records the loss (the context
    group's sum, the mean over the microbatches) and, at step 0, the gradients' fingerprint."""

    def __init__(self, model: ContextModel, opt: torch.optim.Optimizer, tokens: torch.Tensor, plan: PlanFile,
                 groups: ContextGroups) -> None:
        self.module, self.opt, self.tokens, self.plan, self.groups = model, opt, tokens, plan, groups
        self.stage, self.n_stages, self.tp = 0, 1, None
        self.phase, self.step_no = "setup", 0
        self.losses: list[float] = []
        self.first_gradients: dict[str, list[float]] = {}

    def __call__(self) -> None:
        self.phase = "pipeline"
        b, m = self.plan.microbatch, self.plan.microbatches
        ring = self.groups.ring
        total = torch.zeros((), dtype=torch.float64)
        for i in range(m):
            mine = local_part(self.tokens[i * b:(i + 1) * b], ring.size, ring.rank)
            loss = self.module(mine, mine)
            (loss / m).backward()
            total += loss.detach().double().cpu()
        if self.groups.cp_group is not None:
            dist.all_reduce(total, group=self.groups.cp_group)
        self.losses.append(float(total) / m)
        self._reduce_gradients()
        if self.step_no == 0:
            self.first_gradients = gradient_fingerprint(self.module)
        self.phase = "optimizer"
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.phase = "between steps"

    def _reduce_gradients(self) -> None:
        world = dist.get_world_size()
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if world > 1:
                dist.all_reduce(p.grad)
            if self.groups.dp > 1:
                p.grad.div_(self.groups.dp)


# --- the unsplit model, for the check ------------------------------------------------------------


def unsplit_run(cfg: ModelConfig, plan: PlanFile, dp: int, steps: int, seed: int = 0,
                threads: int = 1) -> dict[str, Any]:
    """The same job without context parallelism, in this process: the whole model built
    from the same seed in the same order, each data-parallel index's whole sequences (the
    same tokens), its gradients averaged over the indices, Adam; ``steps`` steps. Returns
    per data-parallel index every step's loss (the mean over the microbatches), and the
    first step's gradient fingerprint."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        layers = nn.ModuleList([Embedding(cfg), *[TransformerLayer(cfg) for _ in range(cfg.layers)], LossHead(cfg)])
        named = _Named(layers)
        opt = torch.optim.Adam(layers.parameters(), lr=LR, foreach=False)
        tokens = [replica_tokens(cfg, plan, r) for r in range(dp)]
        b, m = plan.microbatch, plan.microbatches
        losses: list[list[float]] = [[] for _ in range(dp)]
        first: dict[str, list[float]] = {}
        for step in range(steps):
            for r in range(dp):
                total = 0.0
                for i in range(m):
                    mb = tokens[r][i * b:(i + 1) * b]
                    x = mb
                    for layer in layers[:-1]:
                        x = layer(x)
                    loss = layers[-1](x, mb)
                    (loss / m).backward()
                    total += float(loss.detach())
                losses[r].append(total / m)
            for p in layers.parameters():
                if p.grad is not None:
                    p.grad.div_(dp)
            if step == 0:
                first = gradient_fingerprint(named)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return {"losses": losses, "first_gradients": first}
    finally:
        torch.set_num_threads(before)


class _Named(nn.Module):
    """The unsplit layers under ``ContextModel``'s parameter names (for the fingerprints)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.embed = layers[0]
        self.layers = nn.ModuleList(layers[1:-1])
        self.head = layers[-1]


# --- the worker ----------------------------------------------------------------------------------


def run(job: dict, out_dir: Path) -> dict:
    """This rank's part of the job (module doc): build, train, measure, write ``rank<i>.json``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = PlanFile.model_validate(job["plan"])
    cp = plan.context
    if world != plan.replicas or len(plan.stages) != 1 or world % cp:
        raise SystemExit(f"the context-parallel plan has {plan.replicas} replica(s) of one stage, context {cp}, "
                         f"but {world} processes started")
    cfg = ModelConfig(**job["model"])
    gpu = plan.replica_gpus()[rank][0]
    device = init_process(job, gpu)
    groups = make_groups(cp, device)
    positions = chunk_positions(cfg.seq_len, cp, groups.ring.rank)
    model = ContextModel(cfg, groups.ring, positions).to(device)
    tokens = replica_tokens(cfg, plan, groups.dp_rank)
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    step = ContextStepper(model, opt, tokens.to(device), plan, groups)
    result: dict = {"rank": rank, "replica": rank, "stage": 0, "tp_rank": 0, "gpu": gpu,
                    "cp_rank": groups.ring.rank, "dp_rank": groups.dp_rank, "layers": list(plan.stages[0].layers),
                    "device": str(device), "oom": None, "positions": positions.tolist(),
                    "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}

    def fingerprint(done: dict) -> None:
        done["first_gradients"] = step.first_gradients

    return train_and_record(job, step, model, device, result, out_dir, fingerprint)
