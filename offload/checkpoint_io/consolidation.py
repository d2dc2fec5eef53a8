"""One safetensors file of the whole model from a checkpoint of any world size.

    offload.consolidate("ckpts", "model.safetensors")             # fp32 from the masters
    offload consolidate ckpts model.safetensors --dtype bf16      # the same, from the shell

Names are the module's state_dict names, so the file loads into the plain
model (`safetensors.torch.load_model(model, path)`, or `load_file` and
`model.load_state_dict`). Values: parameters from the fp32 master partitions
of every rank, concatenated in rank order with the padding stripped, then
cast to `dtype`; floating-point buffers cast too, others kept as saved.

Tied weights (one parameter under several names): saved once, under the
model's first name for it, as safetensors and Hugging Face do (safetensors
refuses to store two names for one storage). The other names are listed in
the header metadata, key "offload.tied" (JSON: alias -> saved name).
`safetensors.torch.load_model` restores them; with `load_state_dict` use
strict=False, or tie them afterwards as HF's `tie_weights()` does.

Host memory is bounded by the largest tensor (its fp32 value and its cast):
tensors are built and written one at a time (files.SafetensorsStream).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from tqdm import tqdm

from offload.checkpoint_io import manifest as mf
from offload.checkpoint_io.files import SafetensorsStream
from offload.checkpoint_io.frozen import EXCLUDED
from offload.checkpoint_io.load import RankFiles

log = logging.getLogger("offload")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def consolidate(ckpt_dir, out_path, tag: str | None = None, dtype: torch.dtype = torch.float32,
                progress: bool = True) -> Path:
    """Writes the checkpoint's full model to `out_path` (safetensors); returns the path."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype}: expected torch.float32, torch.bfloat16 or torch.float16")
    # No model here: manifest["model"] describes it. Every rank's files are verified. Format
    # version 1 too: only its tensors are read (Note [no code from a checkpoint]).
    versions = (1, mf.VERSION)
    probe = mf.read_manifest(mf.resolve_tag_dir(ckpt_dir, tag), versions)
    world = probe["model"]["world_size"]
    tag_dir, manifest = mf.load_verified(ckpt_dir, tag, None, range(world), versions)
    model = manifest["model"]
    sources = [RankFiles(tag_dir, manifest, r) for r in range(world)]
    params = {p["index"]: p for p in model["parameters"]}
    buffers = {b["name"]: b for b in model["buffers"]}

    compute_dtype = getattr(torch, model["compute_dtype"])
    excluded = model.get("frozen") == EXCLUDED  # Note [checkpoints without frozen weights]
    left_out = []

    def full_param(p: dict) -> torch.Tensor:
        n = p["part_numel"]
        full = torch.empty(n * world, dtype=torch.float32)
        for r, src in enumerate(sources):
            # A frozen parameter has no master: its saved home value (Note [frozen parameters]).
            full[r * n:(r + 1) * n] = (src.master(p["index"], n) if p.get("state") is not None
                                       else src.param(p["index"], compute_dtype, n))
        numel = 1
        for d in p["shape"]:
            numel *= d
        return full[:numel].view(p["shape"]).to(dtype)

    def buffer(name: str) -> torch.Tensor:
        value = sources[0].tensor(f"buffer.{name}")
        return value.to(dtype) if value.is_floating_point() else value

    plan, make, tied, saved_as = [], [], {}, {}
    for key, what, index in model["state_dict"]:
        if what == "param":
            if excluded and params[index].get("state") is None:
                left_out.append(key)
                continue
            if index in saved_as:
                tied[key] = saved_as[index]
                continue
            saved_as[index] = key
            plan.append((key, dtype, tuple(params[index]["shape"])))
            make.append(lambda p=params[index]: full_param(p))
        elif what == "derived":  # a quantized layer's own state, not in the checkpoint
            left_out.append(key)
        else:
            b = buffers[key]
            saved_dtype = getattr(torch, b["dtype"])
            plan.append((key, dtype if saved_dtype.is_floating_point else saved_dtype, tuple(b["shape"])))
            make.append(lambda key=key: buffer(key))
    # The tag only, not the checkpoint's path: a file shared onwards should not carry
    # the directory layout of the machine it was made on.
    tag_name = tag_dir.name.removeprefix(".").removesuffix(".old")  # `.<tag>.old`: Note [checkpoint layout]
    metadata = {"format": "pt", "offload.source": f"checkpoint tag {tag_name}"}
    if tied:
        metadata["offload.tied"] = json.dumps(tied)
    if left_out:
        metadata["offload.frozen_not_saved"] = json.dumps(left_out)
        log.warning("consolidate: checkpoint tag %s was saved without its frozen weights "
                    "(exclude_frozen_parameters=True): %s holds the %d trainable parameters and the buffers, "
                    "not the %d frozen ones (listed in its metadata, key offload.frozen_not_saved); load it "
                    "over the base model with strict=False", tag_name, out_path, len(saved_as), len(left_out))

    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    total = sum(dt.itemsize * _numel(shape) for _, dt, shape in plan)
    stream = SafetensorsStream(tmp, plan, metadata)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="consolidate",
                  disable=not progress) as bar:
            for (name, dt, shape), build in zip(plan, make):
                stream.write(name, build())
                bar.update(_numel(shape) * dt.itemsize)
        stream.close()
    except BaseException:
        stream.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out_path)
    return out_path


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="directory given to engine.save_checkpoint")
    parser.add_argument("out", help="the safetensors file to write")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                        help="dtype of the floating-point tensors written (default fp32, from the masters)")


def run(args) -> int:
    import sys

    try:
        path = consolidate(args.checkpoint, args.out, tag=args.tag, dtype=DTYPES[args.dtype])
    except (mf.CheckpointError, OSError) as exc:
        print(f"offload consolidate: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
