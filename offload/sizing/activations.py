"""Saved-activation bytes for a model, a batch and a sequence length, before anything
is allocated: the model's forward run on fake tensors.

Note [activation estimate]
What forward saves for backward is what the model's code asks autograd to
save, which no formula over hidden sizes keeps up with (an attention kernel
that saves its scores or only their log-sum-exp, a norm that upcasts, a loss
that saves its log-softmax). So the estimate runs the forward itself, under
torch's FakeTensorMode: every parameter and input a fake tensor of its real
shape and dtype on the host (no memory, no compute; the host's kernels are
chosen, as on a GPU a fused attention's: neither saves its scores), and the
saved-tensor hooks count what autograd keeps, as the engine's saver charges it
(Note [activation bytes] in activations/saver.py): each storage once, however
many saved tensors view it, parameters aside. The loss counts where the
model computes it (Hugging Face's labels=) or where `loss` is given.
Per block (the children of the model's largest nn.ModuleList, as the
activation plan takes them: Note [activations in the plan]) it also counts
what each block saves and its input's bytes, so it can say what every block
checkpointed leaves: what is saved outside the blocks, every block's input,
and one block saved again by its recomputation.
A model whose forward depends on its data (a mixture of experts routing
tokens with nonzero() or a Python loop over the experts hit) cannot run on
fake tensors; Hugging Face's MoE models run with their grouped_mm experts
(their default where torch has grouped_mm), whose shapes do not depend on
the routing. torch's fake grouped_mm accepts only bf16 where the host
kernel takes fp32 too: a shim gives the fp32 output's shape.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload.config import ConfigError


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes forward keeps for backward at the end of forward (its peak), per rank."""

    whole: int  # every block keeping its activations
    blocks: int  # how many blocks
    block: int  # most any block saves
    block_input: int  # the largest block input's bytes
    outside: int  # saved outside the blocks (embeddings, head, loss)

    @property
    def checkpointed(self) -> int:
        """Every block checkpointed: what is saved outside them, each block's input, and one
        block's activations saved again while backward recomputes it."""
        return self.outside + self.blocks * self.block_input + self.block

    def to_dict(self) -> dict:
        return {"whole": self.whole, "checkpointed": self.checkpointed, "blocks": self.blocks,
                "block": self.block, "block_input": self.block_input, "outside": self.outside}


class _FakeGroupedMM(TorchDispatchMode):
    """aten._grouped_mm's output for dtypes torch's fake kernel refuses (fp32; the host's
    kernel takes it): (tokens, out) for a 2-D input and 3-D weights."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is getattr(torch.ops.aten, "_grouped_mm", None):
            a, b = args[0], args[1]
            if a.dtype != torch.bfloat16 and a.dim() == 2 and b.dim() == 3:
                return torch.empty((a.shape[0], b.shape[-1]), dtype=a.dtype, device=a.device)
        return func(*args, **kwargs)


def activation_bytes(model: torch.nn.Module, *inputs, loss: Callable | None = None, **kwargs) -> ActivationBytes:
    """What `model(*inputs, **kwargs)` (then `loss(output)` where given) saves for backward,
    found on fake tensors (Note [activation estimate]). The model may be on the meta device
    (built under `torch.device("meta")`); inputs are real tensors (token ids) or fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from offload.activations.wrap import model_blocks

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    counted: dict[int, int] = {}  # storage -> bytes
    per_block: dict[int, dict[int, int]] = {}
    block_inputs: list[int] = []
    current: list[int] = []
    params: set[int] = set()

    def pack(t: torch.Tensor):
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in params:
                counted[key] = storage.nbytes()
                if current:
                    per_block.setdefault(current[-1], {})[key] = storage.nbytes()
        return t

    def enter(module, args, kw):
        first = next((a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)), None)
        block_inputs.append(0 if first is None else first.numel() * first.element_size())
        current.append(id(module))

    def leave(module, args, kw, out):
        current.pop()

    blocks = model_blocks(model)
    hooks = [b.register_forward_pre_hook(enter, with_kwargs=True) for b in blocks]
    hooks += [b.register_forward_hook(leave, with_kwargs=True) for b in blocks]
    try:
        with mode, _FakeGroupedMM():
            values = {n: torch.empty(p.shape, dtype=p.dtype).requires_grad_(p.requires_grad)
                      for n, p in model.named_parameters()}
            values.update({n: torch.zeros(b.shape, dtype=b.dtype) for n, b in model.named_buffers()})
            params.update(v.untyped_storage()._cdata for v in values.values())
            fake_in = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
            fake_kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = functional_call(model, values, tuple(fake_in), fake_kw)
                if loss is not None:
                    loss(out)
    finally:
        for h in hooks:
            h.remove()
    inside = {k for saved in per_block.values() for k in saved}
    return ActivationBytes(whole=sum(counted.values()), blocks=len(blocks),
                           block=max((sum(s.values()) for s in per_block.values()), default=0),
                           block_input=max(block_inputs, default=0),
                           outside=sum(n for k, n in counted.items() if k not in inside))


def hf_activation_bytes(model_config: str | os.PathLike | Mapping, *, batch: int, seq: int,
                        dtype: torch.dtype) -> ActivationBytes:
    """A Hugging Face causal LM's activation bytes from its config.json (or folder), built on
    the meta device, its loss computed from labels as the Trainer does."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("--seq-len: the activation estimate runs the model's forward on fake tensors and needs "
                          "transformers to build it from its config: pip install transformers") from None
    from offload.sizing.hf_config import load_model_config

    raw, _ = load_model_config(model_config)
    raw = dict(raw)
    if "model_type" not in raw:
        raise ConfigError("--seq-len: the model config names no model_type, which transformers needs to build "
                          "the model")
    cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"), contextlib.redirect_stderr(open(os.devnull, "w")):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    model.train()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return activation_bytes(model, ids, labels=ids)
