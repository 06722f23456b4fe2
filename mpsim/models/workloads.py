"""The model zoo in PyTorch: GPT, BERT and Llama-style decoders, built layer by layer.

The same modules are traced (``mpsim.models.tracer``) and executed for validation, so a trace
and a real run describe the same network. They call ``mpsim.models.kernels`` for dropout,
normalisation and attention, so what a layer keeps for its backward is what the CUDA
kernels keep, even when traced on CPU: with ``attention="eager"`` and dropout a GPT layer
keeps Korthikanti et al.'s s*b*h*(34 + 5*a*s/h) bytes (fp16).

Families:

- ``gpt``: pre-LayerNorm, causal, GELU MLP, learned positions, biases, tied embeddings (GPT-2);
- ``bert``: post-LayerNorm, bidirectional, token types, masked-LM head (BERT);
- ``llama``: pre-RMSNorm, causal, SwiGLU MLP, rotary positions (RoPE), grouped-query
  attention (``kv_heads``), no biases unless ``qkv_bias`` (Qwen2), untied output
  projection (Llama 2/3, Mistral, Qwen2.5).

A Llama layer is written as one of three frameworks writes it (``ModelConfig.framework``,
``FRAMEWORKS``), which changes what it keeps for the backward but not its parameters or
FLOPs:

- ``megatron`` (the default, every shipped trace): one fused q|k|v projection; v reaches
  the attention kernel as a view of its output, so the pre-RoPE q and k stay alive with
  it; a fused RMSNorm; the RoPE cos and sin rebuilt for q and again for k in every layer
  (Megatron-LM's ``SelfAttention.linear_qkv`` and its unfused ``_apply_rotary_pos_emb_bshd``;
  its ``apply_rope_fusion`` kernel, which keeps only the shared frequencies, is not modelled);
- ``hf``: transformers' ``LlamaDecoderLayer``: separate ``q_proj``, ``k_proj``, ``v_proj``,
  the eager ``LlamaRMSNorm`` (it runs in fp32 and keeps an fp32 copy of its input; no fused
  kernel unless one is installed from the hub or Liger), cos and sin built once per forward
  by ``LlamaModel.rotary_emb`` and handed to every layer;
- ``torchtitan``: torchtitan's Llama 3 (``models/llama3``): separate ``wq``, ``wk``, ``wv``,
  ``nn.RMSNorm`` (PyTorch's fused CUDA kernel, ``_fused_rms_norm``), RoPE as a complex64
  ``freqs_cis`` buffer built once per model and read by every layer. (Its mid-2026
  ``FusedQKVLinear`` copies q, k and v out contiguously, which keeps the same bytes.)

A table shared by every layer is counted once: the layers hold it as a non-persistent
buffer (``RotaryTable``), which the tracer leaves out of a layer's saved bytes as it does
parameters, and the embedding keeps one copy for the backward (``hold_for_backward``), so
the embedding row carries its bytes. GPT and BERT layers are the same in every framework
(transformers' ``GPT2Block`` and ``BertLayer`` keep the bytes of mpsim's: tests/test_hf.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from mpsim.models import kernels, tp_ops
from mpsim.models.frameworks import FRAMEWORK_LAYERS as FRAMEWORK_LAYERS  # where callers have found it
from mpsim.models.frameworks import FRAMEWORKS, Framework
from mpsim.models.kernels import AttentionBackend
from mpsim.models.tp_ops import NO_SHARD, TensorShard

Family = Literal["gpt", "bert", "llama"]
FAMILIES: tuple[str, ...] = ("gpt", "bert", "llama")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a model of one of ``FAMILIES``. Parameter count follows from it (``param_count``)."""

    family: Family
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int = 0
    """MLP inner size; 0 means 4 x hidden."""
    dropout: float = 0.1
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means as many as ``heads``."""
    qkv_bias: bool | None = None
    """Biases on the q, k, v projections; None: the family's (GPT, BERT yes; Llama no)."""
    attention: AttentionBackend = "eager"
    rope_theta: float = 10000.0
    framework: Framework = "megatron"
    """How the Llama layer is written (``FRAMEWORKS``, module docstring); GPT and BERT
    layers are the same in every framework."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r}: expected one of {', '.join(FAMILIES)}")
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework {self.framework!r}: expected one of {', '.join(FRAMEWORKS)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout {self.dropout}: expected a probability in [0, 1)")
        kernels.check_backend(self.attention)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def biases(self) -> bool:
        """Biases on every linear layer but the output projection (GPT, BERT)."""
        return self.family != "llama"

    @property
    def has_qkv_bias(self) -> bool:
        return self.biases if self.qkv_bias is None else self.qkv_bias

    @property
    def shared_rope(self) -> bool:
        """A Llama layer with separate q, k, v projections and RoPE tables built once and
        shared by every layer (hf, torchtitan); else a fused q|k|v and, for Llama, tables
        rebuilt in each layer (megatron)."""
        return self.family == "llama" and self.framework != "megatron"

    @property
    def tied(self) -> bool:
        """Output projection tied to the word embedding (GPT-2, BERT), else its own matrix."""
        return self.family != "llama"

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_params(self) -> int:
        """One transformer layer: q, k, v and output projections, the MLP, the norms."""
        h, f, kv_dim = self.hidden, self.ffn, self.kv * self.head_dim
        qkv = h * (h + 2 * kv_dim) + (h + 2 * kv_dim) * self.has_qkv_bias
        if self.family == "llama":
            return qkv + h * h + 3 * h * f + 2 * h
        return qkv + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h

    def embedding_params(self) -> int:
        if self.family == "llama":
            return self.vocab * self.hidden
        types = 2 * self.hidden if self.family == "bert" else 0
        ln = 2 * self.hidden if self.family == "bert" else 0
        return self.vocab * self.hidden + self.seq_len * self.hidden + types + ln

    def head_params(self) -> int:
        """Final norm and, untied, the output projection; BERT's masked-LM transform."""
        h = self.hidden
        if self.family == "llama":
            return h + self.vocab * h
        return 2 * h if self.family == "gpt" else (h * h + 5 * h + self.vocab)

    def param_count(self) -> int:
        """Unique parameters; a tied output projection counts once (the pipeline's last
        stage still holds its own copy)."""
        return self.embedding_params() + self.layers * self.layer_params() + self.head_params()


def shape_of(model: dict) -> ModelConfig | str:
    """The shape a trace's ``model`` block records, to build or retrace it with these
    modules; else why it cannot be (a ``--module`` or ``--hf`` trace, a file without the
    shape, a tensor-parallel shard)."""
    if model.get("family") not in FAMILIES:
        return f"its model block names no family of {', '.join(FAMILIES)} (a CNN or a --module trace)"
    fields = set(ModelConfig.__dataclass_fields__)
    extra = sorted(set(model) - fields)
    if extra:
        return (f"its model block has {', '.join(extra)}, which these modules do not build (a Hugging Face or "
                "tensor-parallel trace)")
    try:
        return ModelConfig(**model)
    except (TypeError, ValueError) as exc:
        return f"its model block is not a whole shape ({exc})"


class Embedding(nn.Module):
    """Word (and position, token type) embeddings. With a tensor-parallel ``shard`` the
    word table is 1/t of the vocabulary (Megatron-LM's vocabulary-parallel embedding),
    its lookups summed over the group; positions are replicated; with sequence
    parallelism the output is the shard's 1/t of the sequence."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard = NO_SHARD) -> None:
        super().__init__()
        self.shard = shard
        self.word = nn.Embedding(-(-cfg.vocab // shard.degree), cfg.hidden)
        learned = cfg.family != "llama"
        self.position = nn.Embedding(cfg.seq_len, cfg.hidden) if learned else None
        self.token_type = nn.Embedding(2, cfg.hidden) if cfg.family == "bert" else None
        self.norm = nn.LayerNorm(cfg.hidden) if cfg.family == "bert" else None
        self.p = cfg.dropout
        self.rope_cfg = cfg if cfg.shared_rope else None
        """hf, torchtitan: the RoPE tables every layer shares, kept here once (module doc)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tp_ops.row_parallel_output(self.word(tokens), self.shard)
        if self.position is not None:
            x = x + self.position(torch.arange(x.shape[1], device=tokens.device))
        if self.token_type is not None:  # a sequence shard's positions under sequence parallelism
            x = x + self.token_type(torch.zeros_like(tokens[:, : x.shape[1]]))
        if self.norm is not None:
            x = self.norm(x)
        x = kernels.dropout(x, self.p, self.training)
        if self.rope_cfg is None:
            return x
        return hold_for_backward(x, *rope_tables(self.rope_cfg, x.dtype, x.device))


class _Hold(torch.autograd.Function):
    """Identity on ``x`` that keeps the other inputs until the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        ctx.kept = len(kept)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *[None] * ctx.kept)


def hold_for_backward(x: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
    """``x``, with ``kept`` alive until the backward: how a trace counts once, on the row that
    builds it, a table that every later layer reads (the RoPE tables of hf and torchtitan)."""
    return _Hold.apply(x, *kept)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class EagerRMSNorm(RMSNorm):
    """transformers' ``LlamaRMSNorm`` as it runs by default, op by op: the input upcast to
    fp32, normalised there, cast back and scaled. It keeps the fp32 copy of its input, one
    fp32 reciprocal RMS per row and the normalised rows in the input's dtype, where a fused
    kernel keeps the input and the reciprocal RMS: 4 more bytes per element at bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.family != "llama":
        return nn.LayerNorm(cfg.hidden)
    return EagerRMSNorm(cfg.hidden) if cfg.framework == "hf" else RMSNorm(cfg.hidden)


def _angles(s: int, d: int, theta: float, device: torch.device | None) -> torch.Tensor:
    """RoPE's angles (s, d/2) in fp32: position p, pair i at p * theta^(-2i/d)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    return torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq)


def _half_split_tables(s: int, d: int, theta: float, dtype: torch.dtype,
                       device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin (s, d) in ``dtype``, half-split layout: pair i's angle in columns
    i and i + d/2."""
    angles = _angles(s, d, theta, device)
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return cos, sin


def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) on (b, heads, s, d) with (s, d) tables:
    transformers' ``apply_rotary_pos_emb`` (multiplications keep cos and sin, not x)."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """megatron: RoPE on (b, heads, s, d) with cos and sin built for this call, so each layer
    keeps its own, for q and again for k (Megatron-LM's unfused ``_apply_rotary_pos_emb_bshd``
    takes cos and sin of its frequencies on every call)."""
    cos, sin = _half_split_tables(x.shape[-2], x.shape[-1], theta, x.dtype, x.device)
    return _rotate_half_split(x, cos, sin)


def _rotate_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``apply_rotary_emb`` on (b, heads, s, d) (torchtitan rotates before it
    moves the heads ahead of the sequence: the same tensors): adjacent pairs of x in fp32
    as complex numbers times ``freqs_cis`` (here its real view, (s, d/2, 2) fp32), cast
    back. The product keeps only the table."""
    s, d = x.shape[-2], x.shape[-1]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], d // 2, 2))
    cis = torch.view_as_complex(freqs.float()[:s])
    return torch.view_as_real(pairs * cis).flatten(-2).type_as(x)


def rope_tables(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """The RoPE tables a shared-table framework builds once for ``cfg.seq_len`` positions:
    hf, cos and sin (s, d) in the activations' dtype (``LlamaRotaryEmbedding``); torchtitan,
    ``freqs_cis`` as (s, d/2, 2) fp32 (``precompute_freqs_cis``'s complex64). 4*s*d bytes
    either way at bf16."""
    d = cfg.head_dim
    if cfg.framework == "hf":
        return _half_split_tables(cfg.seq_len, d, cfg.rope_theta, dtype, device)
    angles = _angles(cfg.seq_len, d, cfg.rope_theta, device)
    return (torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1),)


class RotaryTable(nn.Module):
    """RoPE tables built once per model and read by every layer (hf, torchtitan), held as
    non-persistent buffers: model state, which the tracer leaves out of a layer's saved
    bytes (the embedding's row counts them once, ``Embedding``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    """hf: cos and sin (s, d)."""
    freqs: torch.Tensor
    """torchtitan: freqs_cis as (s, d/2, 2) fp32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.framework = cfg.framework
        tables = rope_tables(cfg, torch.get_default_dtype())
        names = ("cos", "sin") if cfg.framework == "hf" else ("freqs",)
        for name, table in zip(names, tables, strict=True):
            self.register_buffer(name, table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, heads, s, d) rotated as the framework does it."""
        s = x.shape[-2]
        if self.framework == "hf":
            return _rotate_half_split(x, self.cos[:s], self.sin[:s])
        return _rotate_complex(x, self.freqs)


class SelfAttention(nn.Module):
    """q, k, v projections, RoPE (Llama), attention core, output projection.

    megatron (and every GPT or BERT layer): one fused q|k|v projection. hf, torchtitan:
    three (``q``, ``k``, ``v``), rotating with the ``RotaryTable`` every layer shares.

    The forward takes its head counts from the projections' widths, so the same code runs
    a tensor-parallel shard (``shard``: 1/t of the heads and of the KV heads, Megatron-LM's
    column-parallel projections and row-parallel output projection, Shoeybi et al. 2019,
    section 3) and a module that DTensor shards (its q|k|v rows ordered rank by rank, see
    ``qkv_rank_order``). Separate projections share one ``f`` (one collective each way, as
    torchtitan's ``PrepareModuleInput`` gathers once before ``wq``, ``wk``, ``wv``), except
    under Megatron's sequence parallelism, where each is its own ``ColumnParallelLinear``
    keeping the sequence shard: three all-gathers forward."""

    def __init__(self, cfg: ModelConfig, causal: bool, shard: TensorShard = NO_SHARD,
                 rope: RotaryTable | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        t = shard.degree
        kv_dim = cfg.kv * cfg.head_dim
        bias = cfg.has_qkv_bias
        if cfg.shared_rope:
            self.q = nn.Linear(cfg.hidden, cfg.hidden // t, bias=bias)
            self.k = nn.Linear(cfg.hidden, kv_dim // t, bias=bias)
            self.v = nn.Linear(cfg.hidden, kv_dim // t, bias=bias)
            self.rope = rope if rope is not None else RotaryTable(cfg)
        else:
            self.qkv = nn.Linear(cfg.hidden, (cfg.hidden + 2 * kv_dim) // t, bias=bias)
        self.proj = nn.Linear(cfg.hidden // t, cfg.hidden, bias=cfg.biases)
        self.causal = causal
        self.checkpoint_core = False
        """Selective recompute (Korthikanti et al. 2022, section 4.2): the attention core
        keeps only q, k, v and re-runs in the backward (``torch.utils.checkpoint``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (y.transpose(1, 2) for y in self._project(x))
        q, k = self._rotate(q), self._rotate(k)
        b, s = q.shape[0], q.shape[2]
        out = checkpoint(self._core, q, k, v, use_reentrant=False) if self.checkpoint_core else self._core(q, k, v)
        return tp_ops.row_parallel_output(self.proj(out.transpose(1, 2).reshape(b, s, -1)), self.shard)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (b, s, heads, d), k and v (b, s, KV heads, d) of this module's shard."""
        cfg = self.cfg
        if cfg.shared_rope:
            parts = self._separate(x)
        else:
            kv_dim = cfg.kv * cfg.head_dim
            qkv = tp_ops.column_parallel(x, self.qkv, self.shard)
            t = (cfg.hidden + 2 * kv_dim) // qkv.shape[2]  # the tensor-parallel degree this module runs at
            parts = qkv.split([cfg.hidden // t, kv_dim // t, kv_dim // t], dim=2)
        b, s = parts[0].shape[:2]
        return tuple(y.reshape(b, s, -1, cfg.head_dim) for y in parts)

    def _separate(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        linears = (self.q, self.k, self.v)
        if self.shard.sequence_parallel and not self.shard.saves_gathered:
            return tuple(tp_ops.column_parallel(x, linear, self.shard) for linear in linears)
        x = tp_ops.gather_sequence(x, self.shard)
        return tuple(linear(x) for linear in linears)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.family != "llama":
            return x
        if self.cfg.shared_rope:
            return self.rope(x)
        return _rotate(x, self.cfg.rope_theta)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernels.attention(q, k, v, causal=self.causal, dropout_p=self.cfg.dropout, training=self.training,
                                 backend=self.cfg.attention, scale=1.0 / math.sqrt(q.shape[-1]))


class TransformerLayer(nn.Module):
    """GPT and Llama: pre-norm, causal. BERT: post-LayerNorm, bidirectional. With a
    tensor-parallel ``shard`` the attention and the MLP are Megatron-LM's column- then
    row-parallel pairs; the norms, dropouts and residuals run on the whole sequence
    (replicated) or, with sequence parallelism, on the shard's 1/t of it."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard = NO_SHARD, rope: RotaryTable | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.pre_norm = cfg.family != "bert"
        self.ln1 = _norm(cfg)
        self.attn = SelfAttention(cfg, causal=cfg.family != "bert", shard=shard, rope=rope)
        self.ln2 = _norm(cfg)
        swiglu = cfg.family == "llama"
        self.fc = nn.Linear(cfg.hidden, (2 if swiglu else 1) * cfg.ffn // shard.degree, bias=cfg.biases)
        self.out = nn.Linear(cfg.ffn // shard.degree, cfg.hidden, bias=cfg.biases)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.dropout(x, self.cfg.dropout, self.training)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        up = tp_ops.column_parallel(x, self.fc, self.shard)
        if self.cfg.family == "llama":  # SwiGLU (Shazeer 2020): silu(gate) * up, rows ordered rank by rank
            gate, up = up.chunk(2, dim=-1)
            return tp_ops.row_parallel_output(self.out(F.silu(gate) * up), self.shard)
        return self._drop(tp_ops.row_parallel_output(self.out(F.gelu(up)), self.shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self._drop(self.attn(self.ln1(x)))
            return x + self._mlp(self.ln2(x))
        x = self.ln1(x + self._drop(self.attn(x)))
        return self.ln2(x + self._mlp(x))


class LossHead(nn.Module):
    """GPT, Llama: final norm, vocabulary projection, cross-entropy.
    BERT: masked-LM transform (dense, GELU, LayerNorm), vocabulary projection, cross-entropy.
    With a tensor-parallel ``shard`` the projection is column-parallel over the vocabulary
    (1/t of it, rounded up) and the loss is Megatron-LM's vocabulary-parallel cross-entropy."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard = NO_SHARD) -> None:
        super().__init__()
        self.shard = shard
        self.transform = nn.Linear(cfg.hidden, cfg.hidden) if cfg.family == "bert" else None
        self.norm = _norm(cfg)
        self.decoder = nn.Linear(cfg.hidden, -(-cfg.vocab // shard.degree), bias=cfg.family == "bert")

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            x = F.gelu(self.transform(tp_ops.gather_sequence(x, self.shard)))
            logits = self.decoder(self.norm(x))
        else:
            logits = tp_ops.column_parallel(self.norm(x), self.decoder, self.shard)
        if self.shard.degree > 1:
            return tp_ops.vocab_parallel_cross_entropy(logits, labels, self.shard)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def build_layers(cfg: ModelConfig) -> list[nn.Module]:
    """The model as the ordered list of layers a pipeline partitions; hf and torchtitan
    layers share one ``RotaryTable``."""
    rope = RotaryTable(cfg) if cfg.shared_rope else None
    return [Embedding(cfg)] + [TransformerLayer(cfg, rope=rope) for _ in range(cfg.layers)] + [LossHead(cfg)]


def qkv_rank_order(cfg: ModelConfig, degree: int) -> torch.Tensor:
    """Row order of the fused q|k|v projection that puts rank r's q, k and v heads in the
    r-th of ``degree`` equal row blocks (Megatron-LM's per-rank layout), so that DTensor's
    row sharding (``ColwiseParallel``) hands each rank its own heads and the forward's
    split by width stays right."""
    h, kv_dim = cfg.hidden, cfg.kv * cfg.head_dim
    q, k, v = torch.arange(h), torch.arange(h, h + kv_dim), torch.arange(h + kv_dim, h + 2 * kv_dim)
    return torch.cat([torch.cat([part.chunk(degree)[r] for part in (q, k, v)]) for r in range(degree)])


def gate_up_rank_order(cfg: ModelConfig, degree: int) -> torch.Tensor:
    """Row order of Llama's fused gate|up projection with rank r's gate and up rows in the
    r-th of ``degree`` row blocks (see ``qkv_rank_order``)."""
    f = cfg.ffn
    gate, up = torch.arange(f), torch.arange(f, 2 * f)
    return torch.cat([torch.cat([gate.chunk(degree)[r], up.chunk(degree)[r]]) for r in range(degree)])


#: Shipped model sizes. MPress names parameter counts only (Table II); these shapes have
#: them (within 3%) and are fitted by ``benchmarks/fit_table2.py`` so that Table II's
#: per-stage memory (largest stage and total) comes out within 4% (BERT-0.64B: 7%), see
#: traces/README.md. Microbatch and sequence as MPress IV-A uses them. BERT-0.35B is
#: BERT-Large (the paper's reference [1]); GPT shares one width (3840, 30 heads of 128).
GPT_SEQ = 1024
BERT_SEQ = 512
GPT_VOCAB = 50257
BERT_VOCAB = 30522
#: BERT runs fp32 as PipeDream does (MPress IV-C: only DAPPLE enables fp16); GPT runs
#: mixed-precision fp16 as DAPPLE does.
ZOO: dict[str, tuple[ModelConfig, int, str]] = {
    "bert-0.35b": (ModelConfig("bert", 24, 1024, 16, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-0.64b": (ModelConfig("bert", 48, 1024, 16, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-1.67b": (ModelConfig("bert", 42, 1792, 28, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-4b": (ModelConfig("bert", 41, 2816, 44, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-6.2b": (ModelConfig("bert", 159, 1792, 28, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "gpt-5.3b": (ModelConfig("gpt", 29, 3840, 30, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-10.3b": (ModelConfig("gpt", 57, 3840, 30, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-15.4b": (ModelConfig("gpt", 86, 3840, 30, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-20.4b": (ModelConfig("gpt", 114, 3840, 30, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-25.5b": (ModelConfig("gpt", 143, 3840, 30, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    # Small enough to train on a laptop CPU: what `mpsim validate` runs in CI.
    "gpt-tiny": (ModelConfig("gpt", 8, 256, 4, 128, 512), 4, "fp32"),
}


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
           theta: float = 10000.0, qkv_bias: bool = False) -> ModelConfig:
    return ModelConfig("llama", layers, hidden, heads, seq, vocab, ffn_hidden=ffn, dropout=0.0, kv_heads=kv_heads,
                       qkv_bias=qkv_bias, attention="flash", rope_theta=theta)


#: Today's public models, shapes from their config.json files (../shared/reference/models.md),
#: trained in mixed bf16 with FlashAttention-2 at their usual training sequence length.
#: Mistral's sliding window (4096) is not modelled: its attention FLOPs at 8192 are counted in full.
PRESETS: dict[str, tuple[ModelConfig, int, str]] = {
    "llama-2-7b": (_llama(32, 4096, 32, 32, 11008, 32000, 4096), 1, "mixed-bf16"),
    "llama-2-13b": (_llama(40, 5120, 40, 40, 13824, 32000, 4096), 1, "mixed-bf16"),
    "llama-3-8b": (_llama(32, 4096, 32, 8, 14336, 128256, 8192, theta=500000.0), 1, "mixed-bf16"),
    "llama-3-70b": (_llama(80, 8192, 64, 8, 28672, 128256, 8192, theta=500000.0), 1, "mixed-bf16"),
    "mistral-7b": (_llama(32, 4096, 32, 8, 14336, 32000, 8192), 1, "mixed-bf16"),
    "qwen2.5-7b": (_llama(28, 3584, 28, 4, 18944, 152064, 4096, theta=1000000.0, qkv_bias=True), 1, "mixed-bf16"),
    "gpt2-xl": (ModelConfig("gpt", 48, 1600, 25, 1024, GPT_VOCAB, attention="flash"), 4, "mixed-bf16"),
}
ZOO.update(PRESETS)
