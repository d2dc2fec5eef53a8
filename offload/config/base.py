"""Config building blocks: ConfigError, AUTO, the policy enums, strict value
checks (Note [strict values] in offload/config/__init__.py) and _Section,
the frozen-dataclass base every section derives from."""
from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
from pathlib import Path
from typing import Any, ClassVar, Mapping

from offload.tiers import Tier


class ConfigError(ValueError):
    """A configuration value or key that offload does not accept."""


class _Auto:
    """The `"auto"` sentinel: a value resolved from the model by `Config.resolve_auto`."""

    _instance: ClassVar["_Auto | None"] = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "auto"

    def __reduce__(self):
        return (_Auto, ())

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


AUTO = _Auto()

# Mentioned in errors for "auto" where offload cannot resolve it from the model.
_HF_AUTO = ("'auto' here is filled in by the Hugging Face Trainer integration, not derived from "
            "the model; give a value")


# --------------------------------------------------------------------------- enums

class Precision(enum.Enum):
    """Compute dtype of the parameter copy the model runs with (masters are always fp32)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def itemsize(self) -> int:
        return 4 if self is Precision.FP32 else 2

    @property
    def dtype(self):
        import torch

        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
                Precision.FP16: torch.float16}[self]


class OptimizerType(enum.Enum):
    """DeepSpeed's spelling is the value; parsing is case-insensitive ("adamw" works)."""

    ADAM = "Adam"
    ADAMW = "AdamW"


class SchedulerType(enum.Enum):
    WARMUP_LR = "WarmupLR"
    WARMUP_DECAY_LR = "WarmupDecayLR"
    WARMUP_COSINE_LR = "WarmupCosineLR"


class WarmupType(enum.Enum):
    """How the warmup rises from its start to its end (DeepSpeed's default is LOG)."""

    LOG = "log"
    LINEAR = "linear"


# --------------------------------------------------------------------------- value checks

def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _fail(key: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"{key}: {_show(value)} is not {accepted}")


def _show(value: Any) -> str:
    if isinstance(value, Tier):
        return repr(value.offload_device)
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, Path):
        return repr(str(value))
    return repr(value)


def _int(key: str, value: Any, *, lo: int | None = None, hi: int | None = None,
         auto: bool = False, none: bool = False) -> Any:
    """An int (or an integral float, see Note [strict values]) in [lo, hi]."""
    if value is None and none:
        return None
    if value is AUTO or (isinstance(value, str) and value == "auto"):
        if auto:
            return AUTO
        raise ConfigError(f"{key}: 'auto' is not accepted here; give an integer")
    what = "an integer"
    if lo is not None:
        what += f" >= {lo}" if hi is None else f" in [{lo}, {hi}]"
    if auto:
        what += " or 'auto'"
    if none:
        what += " or null"
    if isinstance(value, bool):
        raise _fail(key, value, what)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise _fail(key, value, what)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(key, value, what)
    return value


def _float(key: str, value: Any, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False, none: bool = False,
           hf_auto: bool = False) -> Any:
    if value is None and none:
        return None
    if isinstance(value, str) and value == "auto":
        raise ConfigError(f"{key}: {_HF_AUTO}" if hf_auto else f"{key}: 'auto' is not accepted here")
    lo_s = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
    hi_s = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
    what = "a number"
    if lo is not None and hi is not None:
        what += f" in {lo_s}, {hi_s}"
    elif lo is not None:
        what += f" {'>' if lo_open else '>='} {lo:g}"
    if none:
        what += " or null"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(key, value, what)
    given, value = value, float(value)
    if not math.isfinite(value):
        raise _fail(key, given, what)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise _fail(key, given, what)
    if hi is not None and (value > hi or (hi_open and value == hi)):
        raise _fail(key, given, what)
    return value


def _bool(key: str, value: Any, *, hf_auto: bool = False) -> bool:
    if isinstance(value, str) and value == "auto" and hf_auto:
        raise ConfigError(f"{key}: {_HF_AUTO} (true or false)")
    if not isinstance(value, bool):
        raise _fail(key, value, "true or false")
    return value


def _class_names(key: str, value: Any, example: str) -> tuple[str, ...]:
    """A list of module class names, each once (`example`: one, for the message)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
            isinstance(n, str) and n for n in value):
        raise _fail(key, value, f'a list of module class names (e.g. ["{example}"])')
    if len(set(value)) != len(value):
        raise _fail(key, value, "a list without repeated class names")
    return tuple(value)


def _tier(key: str, value: Any) -> Tier:
    """A Tier, from itself or DeepSpeed's offload `device` spelling ("none", "cpu", "nvme")."""
    if isinstance(value, Tier):
        return value
    if isinstance(value, str) and value in ("none", "cpu", "nvme"):
        return Tier.from_offload_device(value)
    raise _fail(key, value, "one of none, cpu, nvme, auto")


def _enum(key: str, value: Any, cls: type[enum.Enum], *, casefold: bool = False):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if value == member.value or (casefold and value.lower() == member.value.lower()):
                return member
    raise _fail(key, value, "one of " + ", ".join(m.value for m in cls))


_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "512MB", "1.5 GB" (KB/MB = 1000, KiB/MiB = 1024)."""
    if isinstance(value, str):
        m = _BYTES_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _BYTE_UNITS:
            raise ConfigError(f"{key}: {value!r} is not a byte size (an integer, or a number with a unit: "
                              "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        number = float(m.group(1)) * _BYTE_UNITS[unit]
        if not number.is_integer():
            raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
        value = int(number)
    return _int(key, value, lo=0)


def _check_keys(path: str, d: Mapping, accepted: list[str], refused: Mapping[str, str] = {},
                inert: Mapping[str, str] = {}, renamed: Mapping[str, str] = {}) -> None:
    """Unknown keys are errors naming the closest accepted key; refused ones say why.

    Note [DeepSpeed keys]: a DeepSpeed config loads unchanged. Each DeepSpeed
    key is one of: accepted (a field: honoured); renamed (an old or documented
    spelling of one of ours, mapped to it); inert (accepted, has no effect
    here, and `Config.no_effect` names it with the reason, logged once at
    initialize); refused (ignoring it would change what the user gets, so it
    is an error saying what to do). Keys of none of these are typos or
    unknown: errors naming the closest accepted key.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{path or 'config'}: {d!r} is not a JSON object")
    for key in d:
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'config'}: key {key!r} is not a string")
        if key in accepted or key in inert or key in renamed:
            continue
        full = _join(path, key)
        if key in refused:
            raise ConfigError(f"'{full}' is a DeepSpeed key offload does not support: {refused[key]}")
        close = difflib.get_close_matches(key, [*accepted, *inert, *renamed], n=1, cutoff=0.6)
        if close:
            raise ConfigError(f"unknown key '{full}' (did you mean '{close[0]}'?)")
        raise ConfigError(f"unknown key '{full}' (accepted: {', '.join(accepted)})")


def _apply_renames(path: str, d: Mapping, renamed: Mapping[str, str]) -> dict:
    """`d` with each old spelling moved to its new key (Note [DeepSpeed keys]); both given
    with different values is an error naming both."""
    d = dict(d)
    for old, new in renamed.items():
        if old not in d:
            continue
        value = d.pop(old)
        if new in d and d[new] != value:
            raise ConfigError(f"'{_join(path, old)}' ({_show(value)}) and '{_join(path, new)}' "
                              f"({_show(d[new])}) are one setting under two names with different values; "
                              f"keep '{_join(path, new)}'")
        d[new] = value
    return d


class _Section:
    """Shared by every section: SECTION is its dotted place in the config, for errors."""

    SECTION: ClassVar[str] = ""
    # Note [DeepSpeed keys]: key -> reason, or old name -> our name.
    REFUSED: ClassVar[dict] = {}
    INERT: ClassVar[dict] = {}
    RENAMED: ClassVar[dict] = {}
    # Nested sections, by key, for `inert_keys`.
    CHILDREN: ClassVar[dict] = {}
    # Fields derived from a key's value, not keys of their own (to_dict leaves them out).
    NOT_KEYS: ClassVar[tuple] = ()

    def _key(self, name: str) -> str:
        return _join(self.SECTION, name)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @classmethod
    def _accepted(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name not in cls.NOT_KEYS]

    @classmethod
    def from_dict(cls, d: Mapping | None):
        if d is None:
            return cls()
        return cls(**cls._fields_of(d))

    @classmethod
    def _fields_of(cls, d: Mapping) -> dict:
        """The constructor arguments in `d`: keys checked, old names mapped, inert keys dropped."""
        _check_keys(cls.SECTION, d, cls._accepted(), cls.REFUSED, cls.INERT, cls.RENAMED)
        d = _apply_renames(cls.SECTION, d, cls.RENAMED)
        return {k: v for k, v in d.items() if k not in cls.INERT}

    @classmethod
    def inert_keys(cls, d: Mapping | None) -> list[tuple[str, str]]:
        """(dotted key, why it has no effect) for each inert key in the raw dict `d`, nested
        sections included; run after `from_dict` has checked `d`."""
        if not isinstance(d, Mapping):
            return []
        found = [(_join(cls.SECTION, k), cls.INERT[k]) for k in d if k in cls.INERT]
        for key, child in cls.CHILDREN.items():
            found += child.inert_keys(d.get(key))
        return found

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name in self.NOT_KEYS:
                continue
            v = _to_json(getattr(self, f.name))
            if v is not None:
                out[f.name] = v
        return out


def _to_json(v: Any) -> Any:
    if v is AUTO:
        return "auto"
    if isinstance(v, Tier):
        return v.offload_device
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, _Section) or callable(getattr(v, "to_dict", None)):  # a section, or aio's AioConfig
        return v.to_dict()
    return v
