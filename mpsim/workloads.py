"""The model zoo in PyTorch: GPT and BERT, built layer by layer.

The same modules are traced (``mpsim.tracer``) and, later, executed for validation, so a
trace and a real run describe the same network. Attention is written out (scores,
softmax, dropout, weighted sum) rather than fused, so saved activations match the
Megatron accounting of Korthikanti et al. (s*b*h*(34 + 5*a*s/h) bytes per layer in fp16).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

Family = Literal["gpt", "bert"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT or BERT model. Parameter count follows from it (``param_count``)."""

    family: Family
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int = 0
    """MLP inner size; 0 means 4 x hidden."""
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_params(self) -> int:
        """One transformer layer: QKV, projection, two MLP matrices, biases, two LayerNorms."""
        h, f = self.hidden, self.ffn
        return (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h

    def embedding_params(self) -> int:
        types = 2 * self.hidden if self.family == "bert" else 0
        ln = 2 * self.hidden if self.family == "bert" else 0
        return self.vocab * self.hidden + self.seq_len * self.hidden + types + ln

    def param_count(self) -> int:
        """Unique parameters, with the output projection tied to the word embedding (as
        GPT-2 and BERT do); the pipeline's last stage still holds its own copy."""
        head = 2 * self.hidden if self.family == "gpt" else (self.hidden * self.hidden + 5 * self.hidden + self.vocab)
        return self.embedding_params() + self.layers * self.layer_params() + head


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.token_type = nn.Embedding(2, cfg.hidden) if cfg.family == "bert" else None
        self.norm = nn.LayerNorm(cfg.hidden) if cfg.family == "bert" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word(tokens) + self.position(pos)
        if self.token_type is not None:
            x = x + self.token_type(torch.zeros_like(tokens))
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, causal: bool) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = self.attn_drop(F.softmax(scores, dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, h)
        return self.proj(out)


class TransformerLayer(nn.Module):
    """GPT: pre-LayerNorm, causal. BERT: post-LayerNorm, bidirectional."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.family == "gpt"
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg, causal=cfg.family == "gpt")
        self.drop1 = nn.Dropout(cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)
        self.out = nn.Linear(cfg.ffn, cfg.hidden)
        self.drop2 = nn.Dropout(cfg.dropout)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.out(F.gelu(self.fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.drop1(self.attn(self.ln1(x)))
            return x + self._mlp(self.ln2(x))
        x = self.ln1(x + self.drop1(self.attn(x)))
        return self.ln2(x + self._mlp(x))


class LossHead(nn.Module):
    """GPT: final LayerNorm, vocabulary projection, cross-entropy.
    BERT: masked-LM transform (dense, GELU, LayerNorm), vocabulary projection, cross-entropy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.transform = nn.Linear(cfg.hidden, cfg.hidden) if cfg.family == "bert" else None
        self.norm = nn.LayerNorm(cfg.hidden)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab, bias=cfg.family == "bert")

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            x = F.gelu(self.transform(x))
        logits = self.decoder(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def build_layers(cfg: ModelConfig) -> list[nn.Module]:
    """The model as the ordered list of layers a pipeline partitions."""
    return [Embedding(cfg)] + [TransformerLayer(cfg) for _ in range(cfg.layers)] + [LossHead(cfg)]


#: Shipped model sizes. The papers name parameter counts only (MPress Table II); these
#: shapes hit them, see traces/README.md. Microbatch and sequence as MPress IV-A uses them.
GPT_SEQ = 1024
BERT_SEQ = 512
GPT_VOCAB = 50257
BERT_VOCAB = 30522
#: BERT runs fp32 as PipeDream does (MPress IV-C: only DAPPLE enables fp16); GPT runs
#: mixed-precision fp16 as DAPPLE does.
ZOO: dict[str, tuple[ModelConfig, int, str]] = {
    "bert-0.35b": (ModelConfig("bert", 24, 1024, 16, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-0.64b": (ModelConfig("bert", 48, 1024, 16, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-1.67b": (ModelConfig("bert", 32, 2048, 32, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-4b": (ModelConfig("bert", 50, 2560, 40, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "bert-6.2b": (ModelConfig("bert", 54, 3072, 48, BERT_SEQ, BERT_VOCAB), 12, "fp32"),
    "gpt-5.3b": (ModelConfig("gpt", 16, 5120, 40, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-10.3b": (ModelConfig("gpt", 32, 5120, 40, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-15.4b": (ModelConfig("gpt", 48, 5120, 40, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-20.4b": (ModelConfig("gpt", 64, 5120, 40, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    "gpt-25.5b": (ModelConfig("gpt", 80, 5120, 40, GPT_SEQ, GPT_VOCAB), 2, "mixed-fp16"),
    # Small enough to train on a laptop CPU: what `mpsim validate` runs in CI.
    "gpt-tiny": (ModelConfig("gpt", 8, 256, 4, 128, 512), 4, "fp32"),
}
