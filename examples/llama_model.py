"""A small Llama-style decoder in plain torch whose core attention is pluggable.

RMSNorm, rotary position embeddings with positions that restart at every document, SwiGLU MLP and
grouped-query attention (GQA). Inputs are packed: one flat sequence of ``T`` tokens holding several
documents, described by ``doc_lens``. Everything but core attention (embeddings, norms, the QKV and
output projections, rotary embeddings, the MLP, the head) runs here, in the training worker; core
attention ``softmax(Q Kᵀ · scale + causal document mask) V`` is the callable ``attention(q, k, v,
doc_lens)`` — ``DistCAClient.attend`` (attention servers) or ``distca_client.varlen_attention``
(the same math on this process), which is what makes the two runs comparable step for step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# attention(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], doc_lens) -> out [T, Hq, D]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Model sizes. ``hidden`` must be divisible by ``heads``, and ``heads`` by ``kv_heads``."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    mlp_ratio: float = 8 / 3  # SwiGLU's usual width: keeps parameters close to a 4x GELU MLP
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        problems = []
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if self.hidden % max(self.heads, 1):
            problems.append(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % max(self.kv_heads, 1):
            problems.append(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        elif (self.hidden // max(self.heads, 1)) % 2:
            problems.append(f"head_dim={self.hidden // self.heads} must be even (rotary pairs)")
        if problems:
            raise ValueError("model config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        return 32 * round(self.mlp_ratio * self.hidden / 32)  # a multiple of 32, like Llama's

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> x / rms(x) * weight, same shape."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(pos: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each token's position: both [T, 1, head_dim // 2].

    ``pos`` [T] restarts at 0 in each document, so document ``d``'s tokens get the angles they would
    get alone: attention scores inside a document do not depend on where packing put it.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + D/2])`` by each token's angles; x [T, H, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    """Pre-norm decoder layer: ``x + Wo·attention(rope(Wq x), rope(Wk x), Wv x)``, then SwiGLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.wq = nn.Linear(d, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.w_gate = nn.Linear(d, cfg.mlp_hidden, bias=False)
        self.w_up = nn.Linear(d, cfg.mlp_hidden, bias=False)
        self.w_down = nn.Linear(cfg.mlp_hidden, d, bias=False)

    def forward(self, x, cos, sin, doc_lens, attention: Attention):
        """x [T, hidden] -> [T, hidden]; only ``attention`` sees more than one token at a time."""
        T, hd = x.shape[0], self.cfg.head_dim
        h = self.attn_norm(x)
        q = apply_rotary(self.wq(h).view(T, self.cfg.heads, hd), cos, sin)
        k = apply_rotary(self.wk(h).view(T, self.cfg.kv_heads, hd), cos, sin)
        v = self.wv(h).view(T, self.cfg.kv_heads, hd)
        x = x + self.wo(attention(q, k, v, doc_lens).reshape(T, -1))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    """Embedding, ``layers`` decoder blocks, final RMSNorm, untied output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2·layers)
        so the residual stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02 / (2 * self.cfg.layers) ** 0.5 if name.endswith(("wo.weight", "w_down.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, doc_lens: list[int],
                attention: Attention) -> torch.Tensor:
        """tokens [T] int64 and pos [T] (restarting per document) -> logits [T, vocab]."""
        x = self.embed(tokens)
        cos, sin = rotary_tables(pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, doc_lens, attention)
        return self.head(self.norm(x))


def next_byte_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``tokens[t+1]`` at every ``t`` where ``mask[t]``.

    logits [T, vocab], tokens [T] int64, mask [T] bool (False at each document's last token, so no
    prediction crosses a document boundary). Returns a scalar; 0 (still in the graph) when no
    position has a target.
    """
    idx = mask[:-1].nonzero().squeeze(1)
    if idx.numel() == 0:
        return logits.sum() * 0
    return F.cross_entropy(logits[idx], tokens[idx + 1])
