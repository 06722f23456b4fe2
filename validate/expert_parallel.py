"""Mixture-of-experts models with expert parallelism in the executor (plan schema 4, mesh ``ep``).

``mpsim validate --model CONFIG.json --ep e [--dp d] --stages 1`` traces a Hugging Face MoE
config with ``mpsim.models.hf.trace_hf`` (as ``mpsim trace --hf`` does) and runs the same
transformers model here, one process per GPU of the (d, e) mesh, expert innermost
(``mpsim.plans.expert``: tensor, expert, data): rank ``r`` is expert-parallel rank ``r % e``
of data-parallel index ``r // e``, on GPU ``data_parallel.replicas[r][0]``.

What each rank holds and does (what ``mpsim.models.expert_parallel`` simulates):

- the dense part whole (embedding, attention, router, norms, head: the same seed on
  every rank, so the same weights one GPU would have) and the routed experts of its own
  block, ``E/e`` contiguous experts (Megatron-Core's placement): each fused expert weight
  (``gate_up_proj``, ``down_proj``) cut to its rows ``[rank E/e, (rank + 1) E/e)``;
- its own tokens (each rank is a replica of the dense part);
- each MoE layer: the router runs for real (its top-k weights scale the experts' outputs),
  but which expert each routed copy goes to is **forced** to the trace's stated uniform
  load (``mpsim.models.moe``): the T k copies, in token order, go in contiguous blocks of
  ``q = T k / E``, block ``j`` to expert ``j``, so every expert receives exactly ``q``
  copies from every rank. ``ExpertDispatch`` sends each rank's blocks to their experts'
  ranks with one ``all_to_all_single`` (equal splits) and lays the received copies out
  expert by expert; the experts run mpsim's own grouped GEMMs on them
  (``moe._expert_mlp``: the kernels the trace recorded); ``ExpertCombine`` sends the
  outputs back the same way. Backward, the two all-to-alls run in reverse. What the real
  router chose is recorded beside (``RoutedLog``): the copies each rank would have
  received;
- gradients: the dense parameters' all-reduced over the whole (d, e) mesh (data x EP),
  the experts' over the expert-data-parallel group (the mesh's ``dp`` dimension) only,
  after the step's last microbatch, as DDP does; Adam (fp32, not foreach) on the rank's
  own parameters.

With ``e = 1`` the experts run ``moe.uniform_experts_forward`` itself, the traced code.
The microbatches run one after another, forward then backward (1F1B on one stage).
Refused in one line before anything starts (``mpsim.api.jobs.check_moe_runnable`` and
``MOE_FAMILIES``): pipelines, tensor parallelism, ZeRO, actions other than keep, a host
optimizer, a capacity factor, copies that do not split evenly over the experts, and MoE
families other than Mixtral, OLMoE and Qwen3-MoE (routed experts only).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn import functional as F

from mpsim.executor.executor import LR, Stepper, accumulated_loss, init_process, token_ids, train_and_record
from mpsim.models import kernels, moe
from mpsim.plans.plan import PlanFile

EXPERTS_IMPLEMENTATION = "mpsim_expert_parallel"
"""The name ``expert_parallel_forward`` is registered under with transformers."""


# --- the layout ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertMesh:
    """This rank's groups: the (dp, ep) mesh's ``ep`` group (its experts' all-to-alls) and
    ``dp`` group (the expert-data-parallel group), and the whole mesh flattened (the dense
    part's data-parallel group)."""

    mesh: DeviceMesh
    dense: DeviceMesh

    @property
    def ep(self) -> int:
        return self.mesh["ep"].size()

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()


def make_mesh(plan: PlanFile, device: torch.device) -> ExpertMesh:
    """The (dp, ep) mesh over the world, expert innermost; every rank creates it, and the
    flat one, in one order."""
    ep = plan.expert
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    return ExpertMesh(mesh, init_device_mesh(device.type, (world,), mesh_dim_names=("dense",)))


# --- routed copies -------------------------------------------------------------------------------


@dataclass
class RoutedLog:
    """Per MoE layer call of the current step: the copies this rank's experts received
    (forced, uniform) and, per expert-parallel rank, the copies this rank's router chose
    for that rank's experts (what a real dispatch would have sent)."""

    step: int = 0
    received: dict[int, list[int]] = field(default_factory=dict)
    router: dict[int, list[list[int]]] = field(default_factory=dict)

    def note(self, received: int, chosen: torch.Tensor, experts: int, ep: int) -> None:
        with torch.no_grad():
            per_expert = torch.bincount(chosen.reshape(-1), minlength=experts)
            per_rank = per_expert.view(ep, experts // ep).sum(dim=1).tolist()
        self.received.setdefault(self.step, []).append(received)
        self.router.setdefault(self.step, []).append(per_rank)

    def summary(self, step: int, mesh: ExpertMesh) -> dict[str, Any]:
        """What the rank received per MoE layer call in ``step`` (forced) and what the real
        router would have sent it (the ep group's choices for this rank's experts, summed
        over the senders: a collective over the ep group)."""
        calls = self.router.get(step, [])
        chosen = torch.tensor(calls, dtype=torch.long).reshape(len(calls), mesh.ep)
        if mesh.ep > 1:
            dist.all_reduce(chosen, group=mesh.mesh["ep"].get_group())
        return {"step": step, "received_per_call": self.received.get(step, []),
                "router_per_call": chosen[:, mesh.ep_rank].tolist()}


ROUTED = RoutedLog()


# --- dispatch and combine ------------------------------------------------------------------------


def _source_major(x: torch.Tensor, ep: int, local: int) -> torch.Tensor:
    """(local experts, ep x q, h) to (ep x local x q, h): the copies of each rank together."""
    h = x.shape[-1]
    return x.view(local, ep, -1, h).transpose(0, 1).reshape(-1, h)


def _expert_major(x: torch.Tensor, ep: int, local: int) -> torch.Tensor:
    """(ep x local x q, h) to (local experts, ep x q, h): the copies of each expert together."""
    h = x.shape[-1]
    return x.view(ep, local, -1, h).transpose(0, 1).reshape(local, -1, h)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal splits of ``x``'s rows to every rank of ``group``, theirs back (gloo or NCCL)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class ExpertDispatch(torch.autograd.Function):
    """Each rank's routed copies (ep x local x q, h), block ``p`` for rank ``p``'s experts,
    to the ranks of their experts, received as (local experts, ep x q, h); backward, the
    copies' gradients back to their ranks."""

    @staticmethod
    def forward(ctx: Any, copies: torch.Tensor, group: dist.ProcessGroup, ep: int, local: int) -> torch.Tensor:
        ctx.group, ctx.ep, ctx.local = group, ep, local
        return _expert_major(_all_to_all(copies, group), ep, local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(_source_major(grad, ctx.ep, ctx.local), ctx.group), None, None, None


class ExpertCombine(torch.autograd.Function):
    """The experts' outputs (local experts, ep x q, h) back to the ranks their copies came
    from, as (ep x local x q, h) in the copies' own order; backward, the reverse."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, group: dist.ProcessGroup, ep: int, local: int) -> torch.Tensor:
        ctx.group, ctx.ep, ctx.local = group, ep, local
        return _all_to_all(_source_major(out, ep, local), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _expert_major(_all_to_all(grad, ctx.group), ctx.ep, ctx.local), None, None, None


@dataclass(frozen=True)
class ExpertShard:
    """What an experts module of one rank knows of its group (``shard_experts``)."""

    group: dist.ProcessGroup
    ep: int
    experts: int
    """Routed experts of the whole layer."""


def expert_parallel_forward(experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """An ``ExpertsInterface`` function (as ``moe.uniform_experts_forward``): hidden states
    (T, h) and the router's top-k weights (T, k) to the experts' weighted sum per token,
    the copies routed under the forced uniform load (module doc) to the experts of every
    rank of the group. ``top_k_index`` (the real router's choice) is recorded, not used."""
    shard: ExpertShard = experts.mpsim_shard
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    copies, local = tokens * k, shard.experts // shard.ep
    index = torch.arange(copies, device=hidden_states.device) // k
    received = ExpertDispatch.apply(hidden_states.index_select(0, index), shard.group, shard.ep, local)
    ROUTED.note(received.shape[0] * received.shape[1], top_k_index, shard.experts, shard.ep)
    out = moe._expert_mlp(experts, received, *moe._weights(experts))
    back = ExpertCombine.apply(out, shard.group, shard.ep, local)
    weighted = back * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def uniform_forward(experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """Without expert parallelism: ``moe.uniform_experts_forward`` (the traced code), the
    copies and the router's choice recorded."""
    ROUTED.note(top_k_index.numel(), top_k_index, experts.num_experts, 1)
    return moe.uniform_experts_forward(experts, hidden_states, top_k_index, top_k_weights)


def _expert_modules(model: nn.Module) -> list[Any]:
    """transformers' experts modules (``use_experts_implementation``'s: they have ``has_gate``)."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "num_experts")]


def shard_experts(model: nn.Module, mesh: ExpertMesh) -> None:
    """Keep this rank's block of every experts module's fused weights (module doc)."""
    ep, rank = mesh.ep, mesh.ep_rank
    for experts in _expert_modules(model):
        total = int(experts.num_experts)
        local = total // ep
        for name, p in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone()))
        experts.num_experts = local
        experts.mpsim_shard = ExpertShard(mesh.mesh["ep"].get_group(), ep, total)


def is_expert_param(name: str) -> bool:
    """Whether the parameter ``name`` is a routed expert's (reduced over the expert-data group)."""
    return ".experts." in name


# --- the model -----------------------------------------------------------------------------------


def register(transformers: Any) -> None:
    """mpsim's attention and uniform experts (``mpsim.models.hf``), and the two experts
    functions here, registered with transformers."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, expert_parallel_forward)
    ExpertsInterface.register("mpsim_uniform_logged", uniform_forward)


def build_model(model: dict[str, Any], ep: int) -> nn.Module:
    """The transformers model of ``model["hf_config"]`` (fp32, mpsim's attention, the
    experts function for ``ep``), in training mode, weights from the global seed; attention
    runs the traced kernel (``hf._mpsim_attention``, as ``trace_hf`` registers it)."""
    import transformers

    from mpsim.models import hf

    config = transformers.CONFIG_MAPPING[model["hf_config"]["model_type"]].from_dict(model["hf_config"])
    register(transformers)
    transformers.AttentionInterface.register(hf.ATTN_IMPLEMENTATION, hf._mpsim_attention)
    hf._BACKEND.set(kernels.check_backend(model["attention"]))  # the traced kernel, for this process
    impl = EXPERTS_IMPLEMENTATION if ep > 1 else "mpsim_uniform_logged"
    built = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.ATTN_IMPLEMENTATION,
                                                          dtype=torch.float32, experts_implementation=impl)
    return built.train()


class MoeStage(nn.Module):
    """The whole model as one stage: tokens to the microbatch's loss (the tokens as labels),
    the blocks called as the trace calls them (no mask; the rotary tables built once after
    the embedding and handed to every block, as ``LlamaModel.forward`` does)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        m: Any = self.model
        x = m.model.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        tables = m.model.rotary_emb(x, position_ids=positions)
        for block in m.model.layers:
            out = block(x, attention_mask=None, position_ids=positions, position_embeddings=tables)
            x = out if isinstance(out, torch.Tensor) else out[0]
        logits = m.lm_head(m.model.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tokens.view(-1))


def reduce_gradients(stage: nn.Module, mesh: ExpertMesh) -> None:
    """The dense gradients averaged over the whole mesh, the experts' summed over the
    expert-data-parallel group and divided by the world (each expert's gradient already
    holds every ep rank's tokens), in place."""
    world = mesh.dense.size()
    for name, p in stage.named_parameters():
        if p.grad is None:
            continue
        group = mesh.mesh["dp"] if is_expert_param(name) else mesh.dense
        if group.size() > 1:
            dist.all_reduce(p.grad, group=group.get_group())
        if world > 1:
            p.grad.div_(world)


class MoeStepper(Stepper):
    """One training step of the stage: each microbatch forward and backward in turn
    (gradients accumulated, the loss scaled by 1/m), the gradients reduced, Adam's step."""

    def __init__(self, stage: MoeStage, opt: torch.optim.Optimizer, tokens: torch.Tensor, plan: PlanFile,
                 mesh: ExpertMesh) -> None:
        self.module, self.opt, self.tokens, self.plan, self.mesh = stage, opt, tokens, plan, mesh
        self.stage, self.n_stages, self.tp = 0, 1, None
        self.phase, self.step_no = "setup", 0
        self.losses: list[float] = []

    def __call__(self) -> None:
        self.phase = "pipeline"
        ROUTED.step = self.step_no
        loss = accumulated_loss(self.module, self.tokens, self.plan)
        reduce_gradients(self.module, self.mesh)
        self.losses.append(loss)
        self.phase = "optimizer"
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.phase = "between steps"




# --- the worker ----------------------------------------------------------------------------------


def run(job: dict, out_dir: Path) -> dict:
    """This rank's part of the job (module doc): build, train, measure, write ``rank<i>.json``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = PlanFile.model_validate(job["plan"])
    if world != plan.replicas or len(plan.stages) != 1:
        raise SystemExit(f"the MoE plan has {plan.replicas} replica(s) of one stage but {world} processes started")
    gpu = plan.replica_gpus()[rank][0]
    device = init_process(job, gpu)
    mesh = make_mesh(plan, device)
    model = build_model(job["model"], mesh.ep)
    if mesh.ep > 1:
        shard_experts(model, mesh)
    stage = MoeStage(model.to(device))
    hf_config = job["model"]["hf_config"]
    tokens = token_ids(hf_config["vocab_size"], job["model"]["seq_len"], plan, rank)
    opt = torch.optim.Adam(stage.parameters(), lr=LR, foreach=False)
    step = MoeStepper(stage, opt, tokens.to(device), plan, mesh)
    result: dict = {"rank": rank, "replica": rank, "stage": 0, "tp_rank": 0, "gpu": gpu,
                    "ep_rank": mesh.ep_rank, "dp_rank": mesh.dp_rank, "layers": list(plan.stages[0].layers),
                    "device": str(device), "oom": None,
                    "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}
    measured_step = 1 if plan.data_parallel is None else 2  # train's setup steps come first

    def routed(done: dict) -> None:
        done["routed"] = ROUTED.summary(measured_step, mesh)

    return train_and_record(job, step, stage, device, result, out_dir, routed)
