"""Small models with the structures that break parameter managers."""
import math

import torch
from torch import nn
from torch.nn import functional as F


class TinyGPT(nn.Module):
    """Causal LM: tied embedding/LM head, a position parameter read directly in
    the root's forward, attention, MLP, LayerNorm; odd sizes throughout."""

    def __init__(self, vocab=37, hidden=24, heads=3, layers=2, seq=9):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, idx):
        h = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_f(h), self.wte.weight)  # tied LM head


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        # No qkv bias: the key bias gets an exactly-zero gradient (softmax is
        # shift-invariant), whose rounding noise Adam would amplify into steps.
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden + 3)
        self.out = nn.Linear(4 * hidden + 3, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SharedParam(nn.Module):
    """One nn.Parameter owned by two modules, and one module called twice."""

    def __init__(self, vocab=37, hidden=17):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.a = nn.Linear(hidden, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.b.weight = self.a.weight
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        h = torch.tanh(self.a(self.emb(idx)))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.a(h))
        return self.head(h)


class WithUnused(nn.Module):
    """A module never called and a parameter never read, beside a frozen one."""

    def __init__(self, vocab=37, hidden=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.used = nn.Linear(hidden, vocab)
        self.never_called = nn.Linear(hidden, hidden)
        self.never_read = nn.Parameter(torch.randn(5))
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.register_buffer("bias_buf", torch.linspace(-0.1, 0.1, vocab))

    def forward(self, idx):
        return self.used(torch.relu(self.frozen(self.emb(idx)))) + self.bias_buf


class Wide(nn.Module):
    """`layers` Linear(width, width) + tanh on float input, returning its own loss
    (the mean square); the default is 8.4M params, 32 MiB fp32, with tiny
    activations: memory tests whose bytes are the parameters' (tests/engine/
    test_memory.py, rss_run.py). Not in MODELS: it takes no token ids."""

    def __init__(self, layers=8, width=1024):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


MODELS = {"tiny_gpt": TinyGPT, "shared_param": SharedParam, "with_unused": WithUnused}
VOCAB = 37


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update, as a LoRA adapter adds one:
    y = base(x) + (x A^T) B^T * scale."""

    def __init__(self, base: nn.Linear, rank: int = 3, scale: float = 2.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)  # not zero: both get gradients
        self.scale = scale

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


def lora_gpt(hidden=24, layers=2, rank=3, seed=0, dtype=None):
    """TinyGPT with its weights frozen and LoRA adapters on each block's qkv and fc; its
    final LayerNorm trains too (as PEFT's modules_to_save would). dtype: the frozen
    weights rounded to it (a base model loaded in bf16), kept in fp32."""
    torch.manual_seed(seed)
    model = TinyGPT(hidden=hidden, layers=layers)
    if dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    model.requires_grad_(False)
    for block in model.blocks:
        block.qkv = LoRALinear(block.qkv, rank)
        block.fc = LoRALinear(block.fc, rank)
    model.ln_f.requires_grad_(True)
    return model
