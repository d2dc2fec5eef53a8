"""Frozen weights that arrive quantized (a QLoRA base), homed at their quantized size.

Note [quantized frozen weights]
A QLoRA base loaded with bitsandbytes 4-bit (`BitsAndBytesConfig(load_in_4bit=True)`)
holds each Linear4bit weight as a `Params4bit`: packed uint8 data, two 4-bit codes
a byte, shape (out * in / 2, 1), and beside it a `quant_state` (block absmax,
double-quantized where asked, the code book, the original shape and dtype).
Loaded in 8-bit (`load_in_8bit=True`), a Linear8bitLt weight is an `Int8Params`:
int8 data, one byte a weight, with one fp32 scale a row (SCB). The engine
treats the quantized data as the parameter: its home holds those bytes, never
converted to the compute dtype, on whatever tier the plan gives it (4-bit: half
a byte a weight; 8-bit: one), read ahead and brought up like any home. The
quantization state is small (4-bit, blocks of 64: 1/32 of the packed bytes
with double quantization, 1/8 without; 8-bit: 4 bytes a row) and stays
whole beside compute: it is moved to the compute device and counted there. Such a weight is frozen by
construction (bitsandbytes cannot train it): one with requires_grad=True is
refused, naming LoRA.

The layer's arithmetic is bitsandbytes' own, with one change of plumbing.
bitsandbytes' MatMul4Bit keeps the weight for backward as a plain attribute of
its autograd context, a view of whatever storage the weight had in forward
(Linear8bitLt keeps it in its own state.CB, and writes the weight's `.data`
from it after each forward).
Under the engine that storage is a gathered buffer, released (and reused by
another parameter) as soon as the module's forward ends, so backward would read
another weight's bytes. So each Linear4bit and Linear8bitLt whose weight the engine
manages gets a subclass (the same name, `_PAGED` below) whose forward is the
layer's with the matmul done by `Matmul4bit` or `Matmul8bit`: forward calls
bitsandbytes' `matmul_4bit` or `matmul` with grad off (the same kernels and
arguments as its own autograd functions' forward; for 8-bit with state.CB
pointed at the gathered weight for the call only), and backward computes
bitsandbytes' formula (grad_input = grad_output @ the dequantized weight),
with the weight saved through save_for_backward, so
the engine's saved-tensor hooks gather it again for backward as they do any
frozen weight (Note [frozen holds in backward] in partition/manager.py). The
result is bit for bit that of plain bitsandbytes (tests/integrations/test_qlora.py
checks it layer by layer and through PEFT). Two differences, both stated: the CPU
inference repacking of bitsandbytes (its _convert_weight_packed_for_cpu, eval mode
without grad on CPUs with AVX-512 bf16) rewrites the weight in place and is not
done (the unpacked kernel runs: the same values); a bias of another dtype than
the input is cast for the call instead of being converted in place.

While the engine holds an 8-bit layer its state.CB and the weight's CB are
None (they would keep the whole weight in memory); closing the engine points
state.CB at the weight's value given back. torchao's NF4 is a tensor subclass
the engine cannot page yet: it is refused by name.
"""
from __future__ import annotations

import torch

_PAGED: dict[type, type] = {}
FOUR_BIT, EIGHT_BIT = "bitsandbytes-4bit", "bitsandbytes-8bit"


def quantized_kind(p: torch.Tensor) -> str | None:
    """What kind of quantized weight `p` is (FOUR_BIT, EIGHT_BIT, "torchao-nf4"), or
    None for an ordinary tensor (an Int8Params still in fp16 too). Needs neither library."""
    names = {(c.__module__.split(".")[0], c.__name__) for c in type(p).__mro__}
    if ("bitsandbytes", "Params4bit") in names and getattr(p, "quant_state", None) is not None:
        return FOUR_BIT
    if ("bitsandbytes", "Int8Params") in names and not getattr(p, "has_fp16_weights", True):
        return EIGHT_BIT
    if any(n == "NF4Tensor" for _, n in names):  # a Parameter over a subclass has the subclass's type
        return "torchao-nf4"
    return None


def check_quantized(name: str, p: torch.Tensor) -> None:
    """Raises where the engine cannot home `p` correctly (Note [quantized frozen weights])."""
    kind = quantized_kind(p)
    if kind == "torchao-nf4":
        raise TypeError(f"parameter {name} is a torchao NF4Tensor; offload homes bitsandbytes 4-bit and 8-bit "
                        "bases: load the base with transformers' BitsAndBytesConfig(load_in_4bit=True, "
                        "bnb_4bit_quant_type='nf4'), or unquantized")
    if kind is not None and p.requires_grad:
        raise ValueError(f"parameter {name} is a quantized ({kind}) weight with requires_grad=True; a quantized "
                         "weight cannot be trained: freeze it and train adapters beside it (peft's LoRA)")


QUANT_METHODS = ("nf4", "fp4", "int8")  # what a frozen Linear weight may be quantized as
BLOCKSIZE = 64  # bitsandbytes' 4-bit block (its default, and transformers')


def quantized_home(out_features: int, in_features: int, method: str, double: bool = True) -> tuple[int, int]:
    """(home elements, 1 byte each; quantization state bytes) of an out x in Linear
    weight quantized by bitsandbytes as `method` (QUANT_METHODS), double: 4-bit block
    absmax quantized again (QLoRA's double quantization). The closed form of what
    `state_bytes` finds on a quantized weight:
      4-bit    ceil(n / 2) packed bytes; per 64-weight block an absmax, 1 B double-
               quantized (plus per 256 blocks a 4 B absmax, a 256 x 4 B code book and
               a 4 B offset) or 4 B; the 16 x 4 B code book
      int8     n bytes; a 4 B scale per row"""
    n = out_features * in_features
    if method == "int8":
        return n, 4 * out_features
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization {method!r}: expected one of {', '.join(QUANT_METHODS)}")
    blocks = -(-n // BLOCKSIZE)
    side = 16 * 4 + (blocks + 4 * -(-blocks // 256) + 256 * 4 + 4 if double else 4 * blocks)
    return -(-n // 2), side


def state_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a 4-bit weight's quant_state (absmax, code, nested absmax, code, offset)."""
    qs = p.quant_state
    out = [qs.absmax, qs.code]
    if qs.nested:
        out += [qs.offset, qs.state2.absmax, qs.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def state_bytes(p: torch.Tensor) -> int:
    """Bytes of a quantized weight's state, kept whole beside compute: a 4-bit
    quant_state's tensors; an 8-bit weight's fp32 scale a row."""
    if quantized_kind(p) == EIGHT_BIT:
        return p.shape[0] * 4
    return sum(t.numel() * t.element_size() for t in state_tensors(p))


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


class Matmul8bit(torch.autograd.Function):
    """bitsandbytes' 8-bit matmul (LLM.int8(); on the CPU its dequantize-then-linear
    path) with the weight saved through save_for_backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, state):
        import bitsandbytes as bnb

        ctx.scale, ctx.dtype_x, ctx.shape_x = state.SCB, x.dtype, x.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(weight if ctx.needs_input_grad[0] else None)
        state.CB = weight  # the gathered value, for this call only
        try:
            return bnb.matmul(x, weight, bias=bias, state=state)
        finally:
            state.CB = None

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        if grad_output.dim() == 3:
            grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        if ctx.needs_input_grad[0]:
            # as_subclass: Int8Params' own .to() takes no copy=; the values are the same.
            dense = weight.as_subclass(torch.Tensor).to(ctx.dtype_x, copy=True)
            dense.mul_(ctx.scale.unsqueeze(1).mul(1.0 / 127.0))
            grad_x = torch.matmul(grad_output.to(ctx.dtype_x), dense).view(ctx.shape_x)
        return grad_x, None, grad_bias, None


def _forward_4bit(self, x: torch.Tensor) -> torch.Tensor:
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


def _forward_8bit(self, x: torch.Tensor) -> torch.Tensor:
    """Linear8bitLt.forward (bitsandbytes 0.50) with the matmul by Matmul8bit."""
    self.state.is_training = self.training
    bias = self.bias
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return Matmul8bit.apply(x, self.weight, bias, self.state)


def _paged_class(cls: type, forward) -> type:
    if cls not in _PAGED:
        # The same name and qualname: printed models and class-name lookups stay the same.
        _PAGED[cls] = type(cls.__name__, (cls,), {"forward": forward, "__qualname__": cls.__qualname__,
                                                  "__module__": cls.__module__, "_offload_original": cls})
    return _PAGED[cls]


def _layer_kind(module: torch.nn.Module) -> str | None:
    names = {c.__name__ for c in type(module).__mro__}
    return FOUR_BIT if "Linear4bit" in names else EIGHT_BIT if "Linear8bitLt" in names else None


def check_layers(model: torch.nn.Module) -> None:
    """Every quantized weight sits in the bitsandbytes layer of its kind (whose forward
    `_forward_4bit` / `_forward_8bit` mirrors), as `weight`: raised before anything moves."""
    for mod_name, module in model.named_modules():
        for local, p in module._parameters.items():
            kind = None if p is None else quantized_kind(p)
            if kind not in (FOUR_BIT, EIGHT_BIT):
                continue
            if local != "weight" or _layer_kind(module) != kind:
                layer = "Linear4bit" if kind == FOUR_BIT else "Linear8bitLt"
                raise TypeError(f"parameter {mod_name}.{local} is a {kind} weight held by a "
                                f"{type(module).__name__}; offload pages the weights of bitsandbytes' {layer} "
                                "layers only: keep this module unquantized (BitsAndBytesConfig("
                                "llm_int8_skip_modules=[...]))")


def page_modules(model: torch.nn.Module, managed: set[int], device: torch.device) -> list[tuple[torch.nn.Module, type]]:
    """Gives each quantized layer whose weight is in `managed` (ids) the paged class,
    its quantization state on `device`; returns (module, its own class) for `unpage`.
    Before the weights go home: an 8-bit layer's references to its whole weight go."""
    swapped = []
    for module in model.modules():
        weight = module._parameters.get("weight")
        kind = None if weight is None or id(weight) not in managed else quantized_kind(weight)
        if kind not in (FOUR_BIT, EIGHT_BIT) or type(module) in _PAGED.values():
            continue
        cls = type(module)
        if kind == FOUR_BIT:
            weight.quant_state.to(device)  # bitsandbytes' own QuantState.to
        else:
            scale = weight.SCB if weight.SCB is not None else module.state.SCB
            module.state.SCB = scale.to(device)
            weight.CB = weight.SCB = module.state.CB = None
        module.__class__ = _paged_class(cls, _forward_4bit if kind == FOUR_BIT else _forward_8bit)
        swapped.append((module, cls))
    return swapped


def quantized_linear(linear: torch.nn.Linear, frozen, device: torch.device) -> torch.nn.Module:
    """`linear` as bitsandbytes' layer of the kind `frozen.quantize` names (a FrozenConfig),
    its weight quantized on `device` by bitsandbytes as transformers' BitsAndBytesConfig
    loading does (a Params4bit / Int8Params over the weight's values, then .to(device)),
    frozen; the bias is the same parameter. `_is_hf_initialized` is set on the layer and
    its weight: Hugging Face's post_init skips what a checkpoint load set, and would
    otherwise draw the packed weight again."""
    import bitsandbytes as bnb

    has_bias = linear.bias is not None
    values = linear.weight.detach()
    with torch.device("meta"):
        if frozen.quantize == "int8":
            layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                        has_fp16_weights=False, threshold=frozen.int8_threshold)
        else:
            compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(frozen.compute_dtype)
            layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias, compute_dtype=compute,
                                      compress_statistics=frozen.double_quant, quant_type=frozen.quantize)
    if frozen.quantize == "int8":
        layer.weight = bnb.nn.Int8Params(values, requires_grad=False, has_fp16_weights=False).to(device)
    else:
        layer.weight = bnb.nn.Params4bit(values, requires_grad=False, compress_statistics=frozen.double_quant,
                                         quant_type=frozen.quantize, module=layer).to(device)
    if has_bias:
        layer.bias = linear.bias
    layer._is_hf_initialized = layer.weight._is_hf_initialized = True
    return layer


def to_quantize(module: torch.nn.Module, frozen, prefix: str = "") -> list[tuple[str, torch.nn.Linear]]:
    """(dotted name, layer) of each plain nn.Linear in `module`'s subtree that `frozen`
    (a FrozenConfig with quantize set) quantizes: not in skip_modules."""
    found = []
    for name, m in module.named_modules(prefix=prefix):
        if type(m) is torch.nn.Linear and not frozen.skips(name):
            found.append((name, m))
    return found


def check_quantized_base(model: torch.nn.Module, frozen) -> None:
    """frozen.quantize (`frozen`, a FrozenConfig) quantizes as offload.init builds; a model
    built outside it must arrive quantized where it is frozen (a trainable Linear, an
    adapter, stays as it is)."""
    dense = [name for name, m in to_quantize(model, frozen) if not m.weight.requires_grad]
    if dense:
        raise ValueError(f"frozen.quantize is {frozen.quantize!r} but {len(dense)} frozen nn.Linear weights "
                         f"(first: {dense[0]}) are not quantized: frozen.quantize quantizes a base as it is built "
                         "inside offload.init(config); build the model there, or load it quantized "
                         "(transformers' BitsAndBytesConfig(load_in_4bit=True, ...))")


def unpage(swapped: list[tuple[torch.nn.Module, type]]) -> None:
    """Each layer its own class back; an 8-bit layer's state.CB the weight's value
    (after the engine gave the values back)."""
    while swapped:
        module, cls = swapped.pop()
        module.__class__ = cls  # its own class back
        if _layer_kind(module) == EIGHT_BIT:
            module.state.CB = module.weight.data
