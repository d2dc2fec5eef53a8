"""The small state of a checkpoint, in formats whose loading runs no code.

Note [no code from a checkpoint]
A checkpoint is data someone may hand over (a shared run, a download), so
loading one must never execute anything it contains. Pickle does: any object
can name a callable to run when unpickled (`__reduce__`). So nothing on a
load path unpickles:
  - engine_state.json   counters, per-shard step counts, parameter groups, LR
                        scheduler, loss scaler, RNG states, the hyperparameters
                        the run was configured with: JSON, through `encode` /
                        `decode` below (tuples, non-string keys and the few small
                        tensors, the RNG states, are tagged objects);
  - client_state.pt     the user's client_state (DeepSpeed lets it hold anything):
                        torch.save'd, read with torch.load(weights_only=True),
                        torch's restricted unpickler (tensors, numbers, strings,
                        None, lists, tuples, dicts). `client_state_bytes` loads
                        what it wrote the same way at save time, so an object that
                        needs more is refused then, not discovered at resume;
  - tensors             safetensors and byte copies of swap files (load.py).
Format version 1 pickled engine_state.pt; such checkpoints are refused by
version (manifest.read_manifest), except by consolidation, which never read it.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import json
import math
import random

import torch

from offload.checkpoint_io.manifest import CheckpointError

CLIENT_STATE_ALLOWED = ("tensors, numbers, strings, booleans, None, and lists, tuples and dicts of them "
                        "(it is read back with torch.load(weights_only=True), which runs no code: Note "
                        "[no code from a checkpoint])")


# ---- JSON with tags ------------------------------------------------------------
# Every JSON object in the encoding is a tag, so decoding is unambiguous:
# {"tuple": [...]}, {"dict": [[key, value], ...]}, {"tensor": [dtype, shape, [values]]}.
def encode(value, where: str):
    """A JSON-able form of `value`; raises TypeError naming `where` for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() <= 1 << 16:
        return {"tensor": [str(value.dtype).removeprefix("torch."), list(value.shape),
                           value.reshape(-1).tolist()]}
    raise TypeError(f"{where}: a {type(value).__name__} cannot be stored in a checkpoint's engine state")


def decode(value):
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, body), = value.items()
    if tag == "tuple":
        return tuple(decode(v) for v in body)
    if tag == "dict":
        return {decode(k): decode(v) for k, v in body}
    if tag == "float":
        return float(body)
    if tag == "tensor":
        dtype, shape, values = body
        return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
    raise ValueError(f"unknown tag {tag!r}")


def to_json_bytes(state: dict) -> bytes:
    return json.dumps(encode(state, "engine state"), separators=(",", ":")).encode()


def from_json_bytes(data: bytes, where: str) -> dict:
    try:
        return decode(json.loads(data))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"corrupt checkpoint: {where} is not a valid engine state ({exc})") from None


# ---- client_state --------------------------------------------------------------
def client_state_bytes(client_state) -> bytes:
    """client_state serialized, after checking it loads back with weights_only=True."""
    out = io.BytesIO()
    torch.save(client_state, out)
    data = out.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch's UnpicklingError names the offending global
        raise TypeError(f"save_checkpoint(client_state=...): it holds an object a checkpoint cannot "
                        f"load safely ({_reason(exc)}). Allowed: {CLIENT_STATE_ALLOWED}") from None
    return data


def load_client_state(path, where: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure is a refusal, never a fallback
        raise CheckpointError(f"checkpoint {where}: refused, it is not data torch.load(weights_only=True) "
                              f"accepts ({_reason(exc)}); nothing in it was run (Note [no code from a "
                              "checkpoint])") from None


def _reason(exc: Exception) -> str:
    """The line of torch's weights_only error that names what was refused (the rest is advice
    about weights_only=False, which is exactly what must not be done here)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "unsupported" in line.lower() or "WeightsUnpickler error" in line]
    reason = (named or lines or [type(exc).__name__])[0]
    # Not torch's advice to allowlist the global: for a checkpoint from elsewhere that is the attack.
    return reason.split(" was not an allowed global")[0].split(". Please use")[0]


# ---- RNG states ------------------------------------------------------------------
def capture_rng() -> dict:
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": None, "numpy": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy

        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        rng["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    return rng


def restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if rng.get("numpy") is not None:
        try:
            import numpy

            kind, keys, pos, has_gauss, gauss = rng["numpy"]
            numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))
        except ImportError:
            pass


# ---- the hyperparameters a run was configured with -------------------------------
def _plain(value):
    """A JSON-able description of a configured value, for comparison only."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def configured_hyperparameters(view) -> dict:
    """Flat {"optimizer.params.lr": 0.01, ...}: what the config (and initialize's parameter
    groups) set, which a load must not silently replace (Note [optimizer settings at load])."""
    out = {}
    opt = view.config.optimizer.to_dict()
    out["optimizer.type"] = opt["type"]
    out.update({f"optimizer.params.{k}": _plain(v) for k, v in opt["params"].items()})
    sched = view.config.scheduler
    if sched is not None:
        out["scheduler.type"] = _plain(sched.type)
        out.update({f"scheduler.params.{f.name}": _plain(getattr(sched.params, f.name))
                    for f in dataclasses.fields(sched.params)})
    elif view.lr_scheduler is not None:  # initialize(lr_scheduler=callable): the user's object
        out["lr_scheduler.class"] = type(view.lr_scheduler).__qualname__
    for i, group in enumerate(view.param_group_names or []):
        out.update({f"param_groups[{i}].{k}": _plain(v) for k, v in group.items() if k != "params"})
    return out


def hyperparameter_differences(saved: dict, here: dict, prefixes: tuple[str, ...]) -> list[str]:
    keys = sorted(k for k in saved.keys() | here.keys() if k.startswith(prefixes))
    absent = "(not set)"
    return [f"{k}: saved {saved.get(k, absent)!r}, configured {here.get(k, absent)!r}"
            for k in keys if saved.get(k, absent) != here.get(k, absent)]
