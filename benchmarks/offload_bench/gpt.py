"""A GPT-style causal language model in plain PyTorch.

Pre-LayerNorm blocks, causal self-attention through
F.scaled_dot_product_attention, a GELU MLP, learned positions, and an LM head
tied to the token embedding unless tie_embeddings=False. The benchmark model
of the engine issue (vocab 8192, hidden 1024, 4 layers, untied head) has 67M
parameters: GPTConfig(vocab_size=8192, hidden=1024, layers=4, heads=16,
max_seq=128, tie_embeddings=False). The MLP is mlp_ratio x hidden wide unless
mlp_hidden names its width (Llama-2 7B's 11008 is not a multiple of 4096).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    max_seq: int = 256
    mlp_ratio: int = 4
    mlp_hidden: int | None = None  # the MLP's width; None: mlp_ratio x hidden
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"mlp_hidden must be a width >= 1 or None, got {self.mlp_hidden!r}")

    @property
    def mlp_width(self) -> int:
        return self.mlp_ratio * self.hidden if self.mlp_hidden is None else self.mlp_hidden

    def num_params(self) -> int:
        h, v, m = self.hidden, self.vocab_size, self.mlp_width
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * (m * h) + m + h
        head = 0 if self.tie_embeddings else v * h
        return v * h + head + self.max_seq * h + self.layers * block + 2 * h


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.max_seq, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab)."""
        seq = idx.shape[1]
        if seq > self.config.max_seq:
            raise ValueError(f"sequence of {seq} tokens is longer than max_seq={self.config.max_seq}")
        pos = torch.arange(seq, device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            h = block(h)
        h = self.ln_f(h)
        if self.lm_head is not None:
            return self.lm_head(h)
        return F.linear(h, self.wte.weight)  # LM head tied to the embedding


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.hidden
        self.heads = config.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, config.mlp_width)
        self.out = nn.Linear(config.mlp_width, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (targets already shifted by the caller)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
