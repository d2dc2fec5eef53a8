"""The `frozen` section: a frozen base quantized as offload.init builds it (Note [quantized
frozen weights] in offload/partition/quantized.py).

Kept apart from sections.py (already past 500 lines); same conventions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from offload.config.base import _bool, _fail, _float, _Section

QUANTIZE = ("nf4", "fp4", "int8")  # as partition/quantized.py QUANT_METHODS (config sits below partition)
_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True, kw_only=True)
class FrozenConfig(_Section):
    """`frozen`: how a frozen base is held.

    quantize: null (default: in the compute dtype), or "nf4" / "fp4" (bitsandbytes 4-bit,
      QLoRA's) or "int8" (LLM.int8()): every nn.Linear built under offload.init(config),
      but those `skip_modules` names, becomes bitsandbytes' Linear4bit / Linear8bitLt,
      its weight quantized by bitsandbytes as it is attached and homed at its quantized
      size, as transformers' BitsAndBytesConfig(load_in_4bit=True, ...) loads one.
    double_quant: 4-bit block scales quantized again (bnb_4bit_use_double_quant).
    compute_dtype: the 4-bit layers' compute dtype (bnb_4bit_compute_dtype); null:
      bitsandbytes' default. bitsandbytes computes in the input's dtype where it is
      fp32 or bf16.
    skip_modules: module names (the last part, or a dotted suffix) kept unquantized
      (llm_int8_skip_modules); default ["lm_head"], as transformers keeps the output layer.
    int8_threshold: LLM.int8()'s outlier threshold (llm_int8_threshold).
    """

    SECTION: ClassVar[str] = "frozen"
    quantize: str | None = None
    double_quant: bool = True
    compute_dtype: str | None = None
    skip_modules: tuple[str, ...] = ("lm_head",)
    int8_threshold: float = 6.0

    def __post_init__(self):
        k = self._key
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise _fail(k("quantize"), self.quantize, f"one of {', '.join(map(repr, QUANTIZE))}, or null")
        _bool(k("double_quant"), self.double_quant)
        if self.compute_dtype is not None and self.compute_dtype not in _DTYPES:
            raise _fail(k("compute_dtype"), self.compute_dtype, f"one of {', '.join(map(repr, _DTYPES))}, or null")
        skip = self.skip_modules
        if isinstance(skip, str) or not all(isinstance(n, str) and n for n in skip):
            raise _fail(k("skip_modules"), skip, 'a list of module names (["lm_head"])')
        self._set("skip_modules", tuple(skip))
        self._set("int8_threshold", _float(k("int8_threshold"), self.int8_threshold, lo=0.0))

    def skips(self, name: str) -> bool:
        """Whether the module at dotted `name` (or its last part) stays unquantized."""
        return any(name == s or name.endswith("." + s) for s in self.skip_modules)
