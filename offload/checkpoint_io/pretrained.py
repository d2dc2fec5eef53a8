"""engine.save_pretrained(dir): the model in Hugging Face's layout, streamed.

Note [streamed pretrained save]
`model.save_pretrained` (and `model.state_dict()`) would hold every weight
in host memory at once, which a model larger than RAM cannot do. Here the
model's state_dict keys are walked with keep_vars=True (parameter objects,
no values), each parameter is read alone (gathered, copied, released:
Note [reading a parameter outside the engine]) and streamed into the
current safetensors file (SafetensorsStream, files.py), so the process
holds one tensor at a time. Files are cut at max_shard_size and named as
transformers names them (model-00001-of-00003.safetensors and
model.safetensors.index.json, or one model.safetensors), with
{"format": "pt"} metadata, and the model's config (and generation config)
is saved beside them when it has one, so `from_pretrained(dir)` loads the
result. Tied weights are written once, under their first name, as
transformers does; it ties them again on load. With several ranks every
rank calls it (reads are collectives) and rank 0 writes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from offload.checkpoint_io.files import SafetensorsStream
from offload.config.base import parse_bytes


def save_pretrained(view, save_dir, *, max_shard_size="5GB", dtype: torch.dtype | None = None,
                    master: bool = False) -> Path:
    model = view.module
    limit = parse_bytes(max_shard_size, "max_shard_size")
    # master=True: a trained parameter is read from its fp32 master, one at a time too.
    trained = {id(s.param): s for s in view.shards if s.param.requires_grad} if master else {}
    entries, seen = [], set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue  # a tied weight: saved once, under its first name
        seen.add(id(value))
        source_dtype = torch.float32 if id(value) in trained else value.dtype
        out_dtype = dtype if dtype is not None and value.is_floating_point() else source_dtype
        entries.append((key, value, out_dtype))
    files, current, size = [], [], 0
    for entry in entries:
        nbytes = entry[1].numel() * entry[2].itemsize
        if current and size + nbytes > limit:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    files.append(current)

    save_dir = Path(save_dir)
    writer = view.pg.job_rank == 0  # one writer, in group 0 (Note [hybrid sharding])
    if writer:
        save_dir.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    weight_map, total = {}, 0
    for name, group in zip(names, files):
        path = save_dir / name
        tmp = path.with_name(f".{name}.tmp")
        stream = (SafetensorsStream(tmp, [(k, dt, tuple(v.shape)) for k, v, dt in group], {"format": "pt"})
                  if writer else None)
        try:
            for key, value, out_dtype in group:
                with torch.no_grad():
                    if id(value) in trained:
                        tensor = view.full_value(trained[id(value)], master=True).to(out_dtype)
                    else:
                        tensor = value.detach().to(out_dtype)  # an offloaded parameter: read alone
                if stream is not None:
                    stream.write(key, tensor)
                weight_map[key] = name
                total += tensor.numel() * tensor.itemsize
                del tensor
            if stream is not None:
                stream.close()
                os.replace(tmp, path)
        except BaseException:
            if stream is not None:
                stream.abort()
                tmp.unlink(missing_ok=True)
            raise
    if writer:
        for stale in list(save_dir.glob("model*.safetensors")) + list(save_dir.glob("model.safetensors.index.json")):
            if stale.name not in names and not (len(files) > 1 and stale.name.endswith(".index.json")):
                stale.unlink()  # an earlier save's files: from_pretrained would read them first
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (save_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        for attr in ("config", "generation_config"):
            config = getattr(model, attr, None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(save_dir)
    return save_dir


def save_state_dict(view, path, *, dtype: torch.dtype, exclude_frozen: bool = False, streamed: bool) -> None:
    """engine.save_16bit_model: the model's state_dict keys, floating tensors in `dtype`, in one file
    written by rank 0. streamed: one safetensors file, one tensor at a time (tied weights once);
    else DeepSpeed's torch.save of the whole dict (every tied name), refused when it does not fit."""
    model = view.module
    entries, seen = [], set()
    for key, value in model.state_dict(keep_vars=True).items():
        if exclude_frozen and isinstance(value, torch.nn.Parameter) and not value.requires_grad:
            continue
        if streamed and id(value) in seen:
            continue
        seen.add(id(value))
        entries.append((key, value, dtype if value.is_floating_point() else value.dtype))
    path = Path(path)
    writer = view.pg.job_rank == 0  # one writer, in group 0 (Note [hybrid sharding])
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if not streamed:
        import psutil

        need = sum(v.numel() * dt.itemsize for _, v, dt in entries)
        if need > 0.5 * psutil.virtual_memory().available:
            raise MemoryError(f"save_16bit_model({path.name!r}): torch.save holds all {need / 2**30:.1f} GiB at "
                              "once, more than half the memory available; name the file *.safetensors, "
                              "which is streamed one tensor at a time")
        out, copies = {}, {}
        with torch.no_grad():
            for key, value, out_dtype in entries:  # a tied weight: one tensor under each name, as torch saves it
                if id(value) not in copies:
                    copies[id(value)] = value.detach().to(out_dtype, copy=True)
                out[key] = copies[id(value)]
        if writer:
            torch.save(out, tmp)
            os.replace(tmp, path)
        return
    stream = SafetensorsStream(tmp, [(k, dt, tuple(v.shape)) for k, v, dt in entries], {"format": "pt"}) \
        if writer else None
    try:
        for key, value, out_dtype in entries:
            with torch.no_grad():
                tensor = value.detach().to(out_dtype)  # an offloaded parameter: read alone
            if stream is not None:
                stream.write(key, tensor)
            del tensor
        if stream is not None:
            stream.close()
            os.replace(tmp, path)
    except BaseException:
        if stream is not None:
            stream.abort()
            tmp.unlink(missing_ok=True)
        raise
