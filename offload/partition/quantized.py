"""Frozen weights that arrive quantized (a QLoRA base), homed at their quantized size.

Note [quantized frozen weights]
A QLoRA base loaded with bitsandbytes 4-bit (`BitsAndBytesConfig(load_in_4bit=True)`)
holds each Linear4bit weight as a `Params4bit`: packed uint8 data, two 4-bit codes
a byte, shape (out * in / 2, 1), and beside it a `quant_state` (block absmax,
double-quantized where asked, the code book, the original shape and dtype). The
engine treats the packed data as the parameter: its home holds those bytes, in
uint8 and never converted to the compute dtype, on whatever tier the plan gives
it (1 byte a packed element: half a byte a weight), read ahead and brought up
like any home. The quant_state is small (about 1/64 of the packed bytes with
blocksize 64, less with double quantization) and stays whole beside compute: it
is moved to the compute device and counted there. Such a weight is frozen by
construction (bitsandbytes cannot train it): one with requires_grad=True is
refused, naming LoRA.

The layer's arithmetic is bitsandbytes' own, with one change of plumbing.
bitsandbytes' MatMul4Bit keeps the weight for backward as a plain attribute of
its autograd context, a view of whatever storage the weight had in forward.
Under the engine that storage is a gathered buffer, released (and reused by
another parameter) as soon as the module's forward ends, so backward would read
another weight's bytes. So each Linear4bit whose weight the engine manages gets
a subclass (the same name, `_PAGED` below) whose forward is Linear4bit's with
the matmul done by `Matmul4bit`: forward calls bitsandbytes' `matmul_4bit`
with grad off (the same gemm_4bit kernel and arguments as MatMul4Bit's
forward), and backward computes bitsandbytes' formula (grad_input = grad_output
@ dequantize_4bit(weight)), with the weight saved through save_for_backward, so
the engine's saved-tensor hooks gather it again for backward as they do any
frozen weight (Note [frozen holds in backward] in partition/manager.py). The
result is bit for bit that of plain bitsandbytes (tests/integrations/test_qlora.py
checks it layer by layer and through PEFT). Two differences, both stated: the CPU
inference repacking of bitsandbytes (its _convert_weight_packed_for_cpu, eval mode
without grad on CPUs with AVX-512 bf16) rewrites the weight in place and is not
done (the unpacked kernel runs: the same values); a bias of another dtype than
the input is cast for the call instead of being converted in place.

8-bit weights (`Int8Params`, load_in_8bit) keep their bytes in the layer's own
state.CB and write the weight's `.data` after each forward, and torchao's NF4
is a tensor subclass: neither can be paged yet, and each is refused by name.
"""
from __future__ import annotations

import torch

_PAGED: dict[type, type] = {}


def quantized_kind(p: torch.Tensor) -> str | None:
    """What kind of quantized weight `p` is ("bitsandbytes-4bit", "bitsandbytes-8bit",
    "torchao-nf4"), or None for an ordinary tensor. Needs neither library installed."""
    names = {(c.__module__.split(".")[0], c.__name__) for c in type(p).__mro__}
    if ("bitsandbytes", "Params4bit") in names and getattr(p, "quant_state", None) is not None:
        return "bitsandbytes-4bit"
    if ("bitsandbytes", "Int8Params") in names:
        return "bitsandbytes-8bit"
    if any(n == "NF4Tensor" for _, n in names):  # a Parameter over a subclass has the subclass's type
        return "torchao-nf4"
    return None


def check_quantized(name: str, p: torch.Tensor) -> None:
    """Raises where the engine cannot home `p` correctly (Note [quantized frozen weights])."""
    kind = quantized_kind(p)
    if kind == "bitsandbytes-8bit":
        raise TypeError(f"parameter {name} is a bitsandbytes 8-bit weight (Int8Params); offload homes 4-bit "
                        "bases only: load the base with BitsAndBytesConfig(load_in_4bit=True, "
                        "bnb_4bit_quant_type='nf4'), or unquantized")
    if kind == "torchao-nf4":
        raise TypeError(f"parameter {name} is a torchao NF4Tensor; offload homes bitsandbytes 4-bit bases: load "
                        "the base with transformers' BitsAndBytesConfig(load_in_4bit=True, "
                        "bnb_4bit_quant_type='nf4'), or unquantized")
    if kind is not None and p.requires_grad:
        raise ValueError(f"parameter {name} is a quantized ({kind}) weight with requires_grad=True; a quantized "
                         "weight cannot be trained: freeze it and train adapters beside it (peft's LoRA)")


def state_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a 4-bit weight's quant_state (absmax, code, nested absmax, code, offset)."""
    qs = p.quant_state
    out = [qs.absmax, qs.code]
    if qs.nested:
        out += [qs.offset, qs.state2.absmax, qs.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def state_bytes(p: torch.Tensor) -> int:
    """Bytes of a 4-bit weight's quant_state, kept whole beside compute."""
    return sum(t.numel() * t.element_size() for t in state_tensors(p))


def state_to(p: torch.Tensor, device: torch.device) -> None:
    """Moves a 4-bit weight's quant_state to the compute device (bitsandbytes' own QuantState.to)."""
    p.quant_state.to(device)


class Matmul4bit(torch.autograd.Function):
    """bitsandbytes' 4-bit matmul with the weight saved through save_for_backward
    (Note [quantized frozen weights])."""

    @staticmethod
    def forward(ctx, x, weight, bias, quant_state):
        import bitsandbytes as bnb

        ctx.quant_state = quant_state
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(weight if ctx.needs_input_grad[0] else None)
        # Grad is off inside an autograd Function's forward: matmul_4bit takes its
        # gemm_4bit path with the arguments MatMul4Bit.forward passes.
        return bnb.matmul_4bit(x, weight, quant_state=quant_state, bias=bias)

    @staticmethod
    def backward(ctx, grad_output):
        import bitsandbytes as bnb

        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            dense = bnb.functional.dequantize_4bit(weight.view(-1, 1), ctx.quant_state)
            grad_x = torch.matmul(grad_output, dense.to(grad_output.dtype))
        return grad_x, None, grad_bias, None


def _paged_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Linear4bit.forward (bitsandbytes 0.50) with the matmul by Matmul4bit."""
    quant_state = self.weight.quant_state
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = self.bias
    if bias is not None:
        bias = bias.to(x.dtype).to(self.compute_dtype)
    return Matmul4bit.apply(x, self.weight, bias, quant_state).to(inp_dtype)


def _paged_class(cls: type) -> type:
    if cls not in _PAGED:
        # The same name and qualname: printed models and class-name lookups stay the same.
        _PAGED[cls] = type(cls.__name__, (cls,), {"forward": _paged_forward, "__qualname__": cls.__qualname__,
                                                  "__module__": cls.__module__, "_offload_original": cls})
    return _PAGED[cls]


def page_modules(model: torch.nn.Module, managed: set[int]) -> list[tuple[torch.nn.Module, type]]:
    """Gives each 4-bit layer whose weight is in `managed` (ids) the paged class;
    returns (module, its own class) for `unpage`."""
    swapped = []
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None or id(weight) not in managed or quantized_kind(weight) != "bitsandbytes-4bit":
            continue
        cls = type(module)
        if cls in _PAGED.values():
            continue
        module.__class__ = _paged_class(cls)  # undone by unpage (Note [quantized frozen weights])
        swapped.append((module, cls))
    return swapped


def check_layers(model: torch.nn.Module) -> None:
    """Every 4-bit weight sits in a bitsandbytes Linear4bit (the layer whose forward
    `_paged_forward` mirrors), as `weight`: raised before anything moves."""
    for mod_name, module in model.named_modules():
        for local, p in module._parameters.items():
            if p is None or quantized_kind(p) != "bitsandbytes-4bit":
                continue
            if local != "weight" or not any(c.__name__ == "Linear4bit" for c in type(module).__mro__):
                raise TypeError(f"parameter {mod_name}.{local} is a bitsandbytes 4-bit weight held by a "
                                f"{type(module).__name__}; offload pages the weights of bitsandbytes' Linear4bit "
                                "layers only: keep this module unquantized (BitsAndBytesConfig("
                                "llm_int8_skip_modules=[...]))")


def unpage(swapped: list[tuple[torch.nn.Module, type]]) -> None:
    while swapped:
        module, cls = swapped.pop()
        module.__class__ = cls  # its own class back
