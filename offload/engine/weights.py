"""Weights for `offload.initialize(model, config, weights=...)`, read one tensor at a time.

A source is a state dict, a `.safetensors` file, a torch file (`.bin`, `.pt`,
`.pth`; loaded with mmap=True, weights_only=True) or a Hugging Face model
directory (`model.safetensors`, `model.safetensors.index.json`,
`pytorch_model.bin` or `pytorch_model.bin.index.json`, first found wins).
Every source answers shapes and dtypes without reading tensor data, so
`WeightPlan.check` can refuse a mismatch (missing or unexpected keys, a wrong
shape, integer values for a parameter, a meta buffer with no value) before
anything moves; `load(key)` then reads one tensor (safetensors:
`safe_open(..., framework="pt").get_tensor`, memory-mapped).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_HF_FILES = ("model.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "pytorch_model.bin.index.json")
_SHOWN = 5  # keys listed in an error before "and N more"


class WeightsError(ValueError):
    """The weights do not fit the model, or cannot be read."""


class WeightSource:
    """Tensors by key: metadata without reading data, then one tensor at a time."""

    def keys(self) -> list[str]:
        raise NotImplementedError

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        raise NotImplementedError

    def load(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _DictSource(WeightSource):
    def __init__(self, tensors: Mapping, what: str = "state dict"):
        self._tensors = dict(tensors)
        for key, value in self._tensors.items():
            if not isinstance(value, torch.Tensor):
                raise WeightsError(f"weights ({what}): key {key!r} holds a {type(value).__name__}, "
                                   "expected a tensor")

    def keys(self):
        return list(self._tensors)

    def info(self, key):
        t = self._tensors[key]
        return tuple(t.shape), t.dtype

    def load(self, key):
        return self._tensors[key]


class _SafetensorsSource(WeightSource):
    """One or more safetensors files (a sharded checkpoint maps each key to its file)."""

    def __init__(self, file_of_key: dict[str, Path]):
        from safetensors import SafetensorError, safe_open

        self._handles = {}
        self._file_of = {}
        for path in dict.fromkeys(file_of_key.values()):
            try:
                self._handles[path] = safe_open(os.fspath(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise WeightsError(f"weights: cannot read safetensors file {path}: {exc}") from exc
        for key, path in file_of_key.items():
            if key not in self._handles[path].keys():
                raise WeightsError(f"weights: the index maps {key!r} to {path}, which does not hold it")
            self._file_of[key] = path

    @classmethod
    def single(cls, path: Path) -> "_SafetensorsSource":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(os.fspath(path), framework="pt") as f:
                keys = list(f.keys())
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"weights: cannot read safetensors file {path}: {exc}") from exc
        return cls({k: path for k in keys})

    def keys(self):
        return list(self._file_of)

    def info(self, key):
        piece = self._handles[self._file_of[key]].get_slice(key)
        dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise WeightsError(f"weights: {key!r} has safetensors dtype {piece.get_dtype()}, "
                               f"which offload does not read (known: {', '.join(_SAFETENSORS_DTYPES)})")
        return tuple(piece.get_shape()), dtype

    def load(self, key):
        return self._handles[self._file_of[key]].get_tensor(key)

    def close(self):
        self._handles.clear()


def _torch_file(path: Path) -> dict:
    try:
        # mmap: tensor data stays in the page cache until a tensor is read;
        # weights_only: a checkpoint is data, never code to run.
        obj = torch.load(os.fspath(path), map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file
        raise WeightsError(f"weights: cannot read torch file {path}: {exc}") from exc
    if not isinstance(obj, Mapping):
        raise WeightsError(f"weights: torch file {path} holds a {type(obj).__name__}, expected a state dict")
    return dict(obj)


def _read_index(path: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"weights: {path} is not a checkpoint index with a 'weight_map': {exc}") from exc
    files = {}
    for key, name in weight_map.items():
        file = path.parent / name
        if not file.is_file():
            raise WeightsError(f"weights: {path} maps {key!r} to {file}, which does not exist")
        files[key] = file
    return files


def open_weights(weights) -> WeightSource:
    """A WeightSource for a state dict, a file, an index or a Hugging Face directory."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, Mapping):
        return _DictSource(weights)
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(f"weights must be a state dict, a file or a directory, got {type(weights).__name__}")
    path = Path(weights)
    if not path.exists():
        raise FileNotFoundError(f"weights: {path} does not exist")
    if path.is_dir():
        found = next((path / n for n in _HF_FILES if (path / n).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"weights: directory {path} holds none of {', '.join(_HF_FILES)}")
        path = found
    name = path.name
    if name.endswith(".safetensors"):
        return _SafetensorsSource.single(path)
    if name.endswith(".safetensors.index.json"):
        return _SafetensorsSource(_read_index(path))
    if name.endswith(".index.json"):  # sharded torch files
        tensors = {}
        files = _read_index(path)
        for file in dict.fromkeys(files.values()):
            tensors.update(_torch_file(file))
        return _DictSource({k: tensors[k] for k in files if k in tensors}, what=str(path))
    if name.endswith((".bin", ".pt", ".pth")):
        return _DictSource(_torch_file(path), what=str(path))
    raise WeightsError(f"weights: {path}: expected .safetensors, .bin, .pt, .pth, an .index.json "
                       "or a Hugging Face model directory")


def _few(keys) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


# Note [weights of a PEFT model]
# A PEFT model (peft.get_peft_model) renames its base model's parameters:
# `base_model.model.` before each name, `.base_layer.` inside a wrapped layer,
# `.original_module.` / `.modules_to_save.<adapter>.` for a module PEFT keeps
# a trainable copy of. Weights saved from the base model (a Hugging Face
# directory) name them as the base did, so each parameter of a PEFT model
# also takes the value under its base name (both the original and the
# trainable copy, as PEFT copies it). The adapters themselves are not in the
# base's weights: a trainable parameter PEFT made with real values keeps
# them; one on the meta device, like any other, must be given a value.
_PEFT_WRAPPING = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)\.")


def _keys_for(name: str, peft_model: bool) -> tuple[str, ...]:
    """The keys that may hold parameter `name`'s value (Note [weights of a PEFT model])."""
    if not peft_model:
        return (name,)
    base = _PEFT_WRAPPING.sub(".", name.removeprefix("base_model.model."))
    return (name, base) if base != name else (name,)


class WeightPlan:
    """Which key gives each parameter (tied ones: one key, loaded once) and buffer."""

    def __init__(self, source: WeightSource, param_key: dict[int, str], buffer_key: dict[str, str]):
        self.source = source
        self.param_key = param_key    # id(parameter) -> key
        self.buffer_key = buffer_key  # buffer name -> key

    @classmethod
    def check(cls, model: torch.nn.Module, source: WeightSource) -> "WeightPlan":
        """Matches the weights to the model; raises WeightsError listing every problem."""
        keys = source.keys()
        present = set(keys)
        aliases: dict[int, list[str]] = {}
        params = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
            params[id(p)] = p
        buffers = dict(model.named_buffers(remove_duplicate=False))
        problems, param_key, buffer_key = [], {}, {}
        missing = []
        adapters = hasattr(model, "peft_config")  # Note [weights of a PEFT model]
        for pid, names in aliases.items():
            key = next((k for n in names for k in _keys_for(n, adapters) if k in present), None)
            if key is None:
                p = params[pid]
                if adapters and p.requires_grad and p.device.type != "meta":
                    continue  # an adapter PEFT made, with its own initial values
                missing.append(names[0])
                continue
            param_key[pid] = key
            shape, dtype = source.info(key)
            p = params[pid]
            if shape != tuple(p.shape):
                problems.append(f"{key!r} has shape {list(shape)} but the parameter is {list(p.shape)}")
            if not dtype.is_floating_point:
                problems.append(f"{key!r} has dtype {dtype}; a parameter needs floating-point values")
        for name, buf in buffers.items():
            if name in present:
                buffer_key[name] = name
                shape, _ = source.info(name)
                if shape != tuple(buf.shape):
                    problems.append(f"{name!r} has shape {list(shape)} but the buffer is {list(buf.shape)}")
            elif buf.device.type == "meta":
                problems.append(f"buffer {name!r} is on the meta device and the weights have no value for it")
        expected = {k for names in aliases.values() for n in names for k in _keys_for(n, adapters)}
        expected |= set(buffers)
        unexpected = [k for k in keys if k not in expected]
        if missing:
            problems.insert(0, f"missing keys ({len(missing)}): {_few(missing)}")
        if unexpected:
            problems.insert(len(missing) > 0, f"unexpected keys ({len(unexpected)}): {_few(unexpected)}")
        if problems:
            raise WeightsError("weights do not match the model: " + "; ".join(problems))
        return cls(source, param_key, buffer_key)

    def load(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor under `key`, in `dtype`, on the host."""
        return self.source.load(key).to("cpu", dtype)
