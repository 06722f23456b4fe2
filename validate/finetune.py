"""Fine-tuning in the executor: LoRA and QLoRA-style training of a Hugging Face decoder on gloo.

``mpsim.studies.lora_check`` starts this worker under torchrun (``-m mpsim.executor.finetune``),
one process per data-parallel replica of a one-stage plan, with a job whose ``model`` holds
the Hugging Face config, the traced sequence length and attention kernel, and the fine-tune
(``mpsim.models.finetune.FineTune``, as the trace recorded it). Each rank:

- builds the transformers model of the config (fp32, the weights from the job's seed, in
  training mode) with mpsim's attention (``hf._mpsim_attention`` running the traced kernel,
  as ``trace_hf`` registers it);
- for QLoRA, replaces every ``nn.Linear`` of the transformer blocks with
  ``mpsim.models.adapters.QuantizedLinear`` (the packed uint8 weight and its scales, as
  bitsandbytes stores them; its ``dequantize`` writes the full weight for each GEMM, forward
  and backward, zeros here: only bytes matter), as ``adapters.prepare`` does for the trace;
- freezes the base and applies PEFT's LoRA itself (``peft.get_peft_model`` with the trace's
  ``LoraConfig``: rank, alpha, dropout, target modules), so the adapters are PEFT's own and
  its ``get_nb_trainable_parameters`` gives the trainable count compared with the trace's;
  the embedding's output is made to require gradients, as the trace assumes (PEFT's
  ``enable_input_require_grads``), by adding a zero scalar that requires them rather than
  by PEFT's ``requires_grad_`` on the output: that makes the output a leaf, and MemTracker's
  module hooks keep such a leaf and its gradient alive after the backward, so the tracker
  counted every earlier microbatch's (b s h x 4 bytes twice each; a training run without
  the tracker frees them); the sum frees the embedding's output at once, so the bytes are
  the same;
- runs dropout as CUDA's fused kernel (``kernels.CudaDropout``: a 1-byte mask, as the trace
  counts it; CPU's ``F.dropout`` keeps a 4-byte noise tensor), and, on CPU, mpsim's fused
  attention with its output in the queries' layout (``cuda_attention_layout``);
- trains the plan's microbatches one after another, forward then backward, the blocks
  called as the trace calls them (no mask; the rotary tables built once after the
  embedding), the loss of each scaled by 1/m; with replicas, the trained gradients are
  all-reduced and averaged after the step's last microbatch (as DDP does; only the trained
  parameters have gradients); AdamW (fp32, not foreach) over the trained parameters only.

Peak memory, step times and the rank's results go through the executor's shared epilogue
(``executor.train_and_record``: MemTracker on CPU, capped at the device's capacity;
``rank<i>.json``), plus PEFT's trainable and total parameter counts (``peft_params``).

``saved_tensors_by_layer`` runs one microbatch in this process under
``torch.autograd.graph.saved_tensors_hooks`` and returns the bytes autograd keeps per
layer, to hold against the trace's rows where a prediction is off.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mpsim.executor.executor import (
    LR,
    Stepper,
    accumulated_loss,
    init_process,
    token_ids,
    train_and_record,
    worker_main,
)
from mpsim.models.finetune import FineTune
from mpsim.plans.plan import PlanFile

# --- the model -----------------------------------------------------------------------------------


def build_model(model: dict[str, Any]) -> nn.Module:
    """The transformers model of ``model["hf_config"]`` (fp32, mpsim's attention running the
    traced kernel), weights from the global seed, in training mode, not yet adapted."""
    import transformers

    from mpsim.models import hf, kernels

    config = transformers.CONFIG_MAPPING[model["hf_config"]["model_type"]].from_dict(model["hf_config"])
    transformers.AttentionInterface.register(hf.ATTN_IMPLEMENTATION, hf._mpsim_attention)
    hf._BACKEND.set(kernels.check_backend(model["attention"]))  # the traced kernel, for this process
    built = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.ATTN_IMPLEMENTATION,
                                                          dtype=torch.float32)
    return built.train()


def quantize_blocks(model: nn.Module, spec: FineTune) -> int:
    """Every ``nn.Linear`` of the transformer blocks replaced by a ``QuantizedLinear`` (as
    ``adapters._quantize`` does for the trace: the blocks' linear layers, not the head);
    returns how many."""
    from mpsim.models.adapters import QuantizedLinear

    assert spec.quant is not None
    blocks: Any = model.model.layers  # type: ignore[union-attr]
    n = 0
    for parent in list(blocks.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, QuantizedLinear(child, spec.quant, spec.double_quant))
                n += 1
    return n


def lora_config(spec: FineTune) -> Any:
    """PEFT's ``LoraConfig`` of ``spec`` (the trace's adapters)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,  # type: ignore[arg-type]
                      target_modules=spec.target_modules, use_dora=spec.use_dora,
                      modules_to_save=spec.modules_to_save or None)


def adapt(model: nn.Module, spec: FineTune) -> Any:
    """``model`` frozen, its blocks quantized for QLoRA, and PEFT's LoRA applied
    (``peft.get_peft_model``); the embedding's output requires gradients. The PEFT model."""
    from peft import get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    if spec.quant is not None:
        quantize_blocks(model, spec)
    return get_peft_model(model, lora_config(spec))


class FineTuneStage(nn.Module):
    """The whole model as one stage: tokens to the microbatch's loss (the tokens as labels),
    the blocks called as the trace calls them (no mask; the rotary tables built once after
    the embedding and handed to every block, as ``LlamaModel.forward`` does)."""

    anchor: torch.Tensor

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        self.peft_model = peft_model
        self.anchor = torch.zeros((), requires_grad=True)  # not a parameter: nothing trains it

    @property
    def causal_lm(self) -> Any:
        return self.peft_model.get_base_model()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from mpsim.models import kernels

        with kernels.CudaDropout():  # PEFT's lora_dropout as CUDA's fused dropout: a 1-byte mask
            return self._loss(tokens)

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.causal_lm
        x = m.model.embed_tokens(tokens) + self.anchor  # requires gradients (module doc), no leaf of b s h
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        tables = m.model.rotary_emb(x, position_ids=positions)
        for block in m.model.layers:
            out = block(x, attention_mask=None, position_ids=positions, position_embeddings=tables)
            x = out if isinstance(out, torch.Tensor) else out[0]
        return head_loss(m, x, tokens)


def head_loss(causal_lm: Any, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trace's head: final norm, vocabulary projection, cross-entropy in fp32."""
    logits = causal_lm.lm_head(causal_lm.model.norm(x))
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def build_stage(model: dict[str, Any]) -> FineTuneStage:
    """The adapted model of the job's ``model`` block as one stage."""
    spec = FineTune.model_validate(model["fine_tune"])
    return FineTuneStage(adapt(build_model(model), spec))


def _cpu_attention_in_query_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                                   lse_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mpsim.models import kernels

    out, lse = kernels._attention_reference(q, k, v, causal, scale)
    padded = -(-q.shape[2] // lse_rows) * lse_rows
    return torch.empty_like(q).copy_(out), F.pad(lse, (0, padded - lse.shape[-1]))


_LAYOUT_KERNEL: list[Any] = []
"""The CPU kernel above, once registered (disabled outside ``cuda_attention_layout``)."""


@contextmanager
def cuda_attention_layout() -> Iterator[None]:
    """Inside, the CPU kernel of ``mpsim::fused_attention`` returns its output in the
    queries' memory layout, as its FakeTensor kernel does and as CUDA's fused kernels
    (FlashAttention, memory-efficient) return it: (b, s, a, d) in memory for the (b, a, s, d)
    queries a transformers block makes. The reference CPU kernel returns it contiguous
    (b, a, s, d), so ``_mpsim_attention``'s ``transpose(1, 2).contiguous()`` copies it and
    the ``o_proj`` adapter saves that copy: b s h x 4 bytes a layer more than on CUDA, and
    than the trace counts (where the copy is a view of the saved output). Outside, the
    operator's own CPU kernel runs, as before."""
    from mpsim.models import kernels

    op = kernels._fused_attention
    if not _LAYOUT_KERNEL:
        op.register_kernel("cpu")(_cpu_attention_in_query_layout)
        off = op.set_kernel_enabled("cpu", False)
        off.__enter__()  # held disabled for the process's life, but inside this context
        _LAYOUT_KERNEL.append(off)
    with op.set_kernel_enabled("cpu", True):
        yield


def trained(stage: nn.Module) -> list[nn.Parameter]:
    return [p for p in stage.parameters() if p.requires_grad]


def peft_params(stage: FineTuneStage) -> dict[str, int]:
    """PEFT's own counts (``get_nb_trainable_parameters``): trainable and all (a quantized
    layer's packed uint8 weight counted as its elements, as PEFT counts any tensor that is
    not bitsandbytes' ``Params4bit``)."""
    n_trained, n_all = stage.peft_model.get_nb_trainable_parameters()
    return {"trainable": int(n_trained), "all": int(n_all)}


# --- training ------------------------------------------------------------------------------------


def reduce_gradients(params: list[nn.Parameter], world: int) -> None:
    """The trained parameters' gradients averaged over the replicas, in place."""
    if world == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


class FineTuneStepper(Stepper):
    """One training step: each microbatch forward and backward in turn (gradients
    accumulated, the loss scaled by 1/m), the gradients reduced over the replicas, AdamW's
    step over the trained parameters."""

    def __init__(self, stage: FineTuneStage, opt: torch.optim.Optimizer, tokens: torch.Tensor,
                 plan: PlanFile, world: int) -> None:
        self.module, self.opt, self.tokens, self.plan, self.world = stage, opt, tokens, plan, world
        self.params = trained(stage)
        self.stage, self.n_stages, self.tp = 0, 1, None
        self.phase, self.step_no = "setup", 0
        self.losses: list[float] = []

    def __call__(self) -> None:
        self.phase = "pipeline"
        loss = accumulated_loss(self.module, self.tokens, self.plan)
        reduce_gradients(self.params, self.world)
        self.losses.append(loss)
        self.phase = "optimizer"
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.phase = "between steps"




def make_optimizer(stage: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trained parameters only (fp32, not foreach, as the executor's Adam)."""
    return torch.optim.AdamW(trained(stage), lr=LR, foreach=False)


# --- saved tensors, for attributing a gap --------------------------------------------------------


@contextmanager
def _saved_by_owner(stage: FineTuneStage, into: dict[str, int]) -> Iterator[None]:
    """Bytes autograd saves while each top-level part (embedding, block i, head) runs, each
    storage once across the run; parameters and buffers of the model left out (the trace
    leaves them out of a row's saved bytes too)."""
    m = stage.causal_lm
    own = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in stage.buffers()}
    seen: set[int] = set()
    where = ["embedding"]
    hooks = []
    parts = [("embedding", m.model.embed_tokens), ("head", m.model.norm)]
    parts += [(f"layer{i}", block) for i, block in enumerate(m.model.layers)]
    for name, mod in parts:
        hooks.append(mod.register_forward_pre_hook(lambda _m, _a, name=name: where.__setitem__(0, name)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and ptr not in seen:
            seen.add(ptr)
            into[where[0]] = into.get(where[0], 0) + t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in hooks:
            h.remove()


def saved_tensors_by_layer(model: dict[str, Any], microbatch: int, seed: int = 0) -> dict[str, int]:
    """Bytes autograd keeps for the backward, by part of the model (``embedding``, ``layer<i>``,
    ``head``: from the final norm on), over one microbatch's forward run in this process."""
    torch.manual_seed(seed)
    stage = build_stage(model)
    cfg = model["hf_config"]
    tokens = torch.randint(0, cfg["vocab_size"], (microbatch, model["seq_len"]),
                           generator=torch.Generator().manual_seed(1))
    saved: dict[str, int] = {}
    with cuda_attention_layout():
        with _saved_by_owner(stage, saved):
            loss = stage(tokens)
        loss.backward()
    return saved


class _BackwardPeak:
    """The most bytes a ``CappedMemTracker`` saw on the CPU inside autograd's backward."""

    def __init__(self) -> None:
        from mpsim.executor.executor import CappedMemTracker

        peak = self

        class Tracker(CappedMemTracker):
            def _update_peak_stats(self, peak_state: Any) -> None:
                super()._update_peak_stats(peak_state)
                if torch._C._current_graph_task_id() != -1:
                    used = self._curr_mem_snap.get(torch.device("cpu"), {}).get("Total", 0)
                    peak.bytes = max(peak.bytes, used)

        self.bytes = 0
        self.tracker = Tracker(torch.device("cpu"), None)


def head_backward_workspace(model: dict[str, Any], microbatch: int, seed: int = 0) -> int:
    """Peak bytes the head's backward (final norm, vocabulary projection, cross-entropy)
    allocates beyond what stood after its forward and its input gradient, measured here
    as ``mpsim.models.profiler.backward_workspace_bytes`` measures a layer for ``mpsim
    trace --measure`` (that one registers gradient hooks on every parameter, which a frozen
    head refuses, so the tracker here is the executor's, without per-module hooks)."""
    torch.manual_seed(seed)
    stage = build_stage(model)
    m, cfg = stage.causal_lm, model["hf_config"]
    x = torch.randn(microbatch, model["seq_len"], cfg["hidden_size"], requires_grad=True)
    labels = torch.randint(0, cfg["vocab_size"], (microbatch, model["seq_len"]))
    head_loss(m, x, labels).backward()  # steady state: any trained weight's gradient exists
    x.grad = None
    peak = _BackwardPeak()
    peak.tracker.track_external(stage)
    with peak.tracker:
        loss = head_loss(m, x, labels)
        base = peak.tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        loss.backward()
    grad_in = x.numel() * x.element_size()
    return max(0, int(peak.bytes - base - grad_in))


# --- the worker ----------------------------------------------------------------------------------


def run(job: dict, out_dir: Path) -> dict:
    """This rank's part of the job (module doc): build, train, measure, write ``rank<i>.json``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = PlanFile.model_validate(job["plan"])
    if world != plan.replicas or len(plan.stages) != 1:
        raise SystemExit(f"the fine-tuning plan has {plan.replicas} replica(s) of one stage but {world} processes "
                         "started")
    gpu = plan.replica_gpus()[rank][0]
    device = init_process(job, gpu)
    stage = build_stage(job["model"]).to(device)
    cfg = job["model"]["hf_config"]
    tokens = token_ids(cfg["vocab_size"], job["model"]["seq_len"], plan, rank)
    step = FineTuneStepper(stage, make_optimizer(stage), tokens.to(device), plan, world)
    result: dict = {"rank": rank, "replica": rank, "stage": 0, "tp_rank": 0, "gpu": gpu,
                    "layers": list(plan.stages[0].layers), "device": str(device), "oom": None,
                    "peft_params": peft_params(stage),
                    "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}
    with cuda_attention_layout():
        return train_and_record(job, step, stage, device, result, out_dir)


def main() -> None:
    worker_main(run, __doc__.splitlines()[0], "mpsim.studies.lora_check")


if __name__ == "__main__":
    main()
