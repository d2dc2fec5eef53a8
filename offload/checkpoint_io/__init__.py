"""Checkpoints: crash-safe, exactly resumable saves of an engine, and consolidation.

    tag = engine.save_checkpoint("ckpts", client_state={"epoch": 3})   # every rank calls it
    path, client_state = engine.load_checkpoint("ckpts")               # the tag `latest` names
    offload.consolidate("ckpts", "model.safetensors")                  # one file, plain PyTorch

Layout and commit protocol: Note [checkpoint layout] (manifest.py). What is
captured when, and how an async save stays consistent while training goes
on: Note [consistent async checkpoint] (save.py).

Note [one word, two concepts]
Users say "checkpoint" for two things: a saved training state (DeepSpeed's
save_checkpoint / load_checkpoint, a ckpts/ directory) and recomputing
activations in backward (torch.utils.checkpoint.checkpoint, DeepSpeed's
`activation_checkpointing` key). Inside offload the noun means the first only:
this package and the engine's save/load methods. Activation recomputation
lives in offload/activations/ (recompute.py); the public names users type for
it, `offload.checkpoint(fn, *args)` and the config key, keep torch's and
DeepSpeed's spelling because they are what users replace.
"""
from offload.checkpoint_io.manifest import CheckpointError


def save_checkpoint(view, save_dir, tag=None, client_state=None, async_save=False, save_latest=True,
                    exclude_frozen=False):
    """Starts (async_save) or performs a save; returns the SaveJob (finish() commits)."""
    from offload.checkpoint_io.save import SaveJob

    return SaveJob(view, save_dir, tag, client_state, async_save, save_latest, exclude_frozen)


def load_checkpoint(view, load_dir, tag=None, **parts):
    """(tag directory, client_state); parts: load.load_into's keywords."""
    from offload.checkpoint_io.load import load_into

    return load_into(view, load_dir, tag, **parts)


def consolidate(ckpt_dir, out_path, tag=None, dtype=None, progress=True):
    """A checkpoint's full model (saved at any world size) as one safetensors file.

    ckpt_dir: the folder save_checkpoint wrote (its root, or one tag's folder); tag: which of its checkpoints (default: the
    `latest` one); dtype: torch.float32 (default), torch.bfloat16 or torch.float16, or
    their names; progress: a progress bar on stderr. Every rank's files are
    verified before anything is written. Returns the path written.
    """
    import torch

    from offload.checkpoint_io.consolidation import consolidate as _consolidate

    return _consolidate(ckpt_dir, out_path, tag=tag, dtype=torch.float32 if dtype is None else dtype,
                        progress=progress)


__all__ = ["CheckpointError", "consolidate", "load_checkpoint", "save_checkpoint"]
