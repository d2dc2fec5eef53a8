"""Checkpoints without the frozen weights: what they record of them, and the check at load.

Note [checkpoints without frozen weights]
`save_checkpoint(..., exclude_frozen_parameters=True)` writes the trainable
state alone (Note [frozen parameters] in offload/placement.py): no partition
of a frozen parameter, which for a LoRA is nearly every byte of the model.
In their place each rank's engine_state.json records a fingerprint of the
frozen partitions it holds: per parameter its name, shape, compute dtype
and a checksum of this rank's partition (`frozen_fingerprint`), and the
manifest's model description says `"frozen": "excluded"`. Such a checkpoint
loads only into an engine built on the same frozen weights: load computes
the same fingerprint and refuses, naming each parameter that differs, before
anything changes; the frozen homes are then left as they are, and the
trainable state resumes bit for bit. The fingerprint is per rank's
partition, so resuming at another world size is refused (save with the
frozen weights for that). Consolidation writes the trainable parameters
only, and says so. Computing the fingerprint reads every frozen partition
once per engine (kept until an edit through offload.gathered or a load
rewrites a frozen home).
"""
from __future__ import annotations

from offload.aio.checksum import checksum
from offload.checkpoint_io import files
from offload.checkpoint_io import manifest as mf

EXCLUDED = "excluded"


def frozen_fingerprint(view) -> dict[str, dict]:
    """shard.index (as a string, JSON's keys) -> name, shape, dtype and checksum of this
    rank's partition, for every frozen shard (computed once, then kept: see the Note)."""
    kept = view.frozen_fingerprints
    kind = files.kind()
    for s in view.shards:
        if s.trainable or str(s.index) in kept:
            continue
        crc = checksum(kind, s.home_partition().contiguous())
        kept[str(s.index)] = {"name": s.name, "shape": list(s.shape),
                              "dtype": str(s.dtype).removeprefix("torch."),
                              "checksum": kind.name, "crc": crc}
    return dict(kept)


def check_same_base(view, saved: dict | None, saved_world: int) -> list[str]:
    """Why a checkpoint saved without its frozen weights cannot load into `engine` (empty: it can):
    `saved` is its engine_state's frozen_fingerprint."""
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        return ["corrupt checkpoint: saved without its frozen weights but with no valid fingerprint of them"]
    if saved_world != view.pg.world_size:
        return [f"it was saved without its frozen weights by {saved_world} rank(s), and their "
                f"fingerprint is per rank: resume at {saved_world} rank(s), or save with the frozen "
                "weights (exclude_frozen_parameters=False) to resume at another world size"]
    here = frozen_fingerprint(view)
    problems = []
    if saved.keys() != here.keys():
        names = {**{k: v["name"] for k, v in saved.items()}, **{k: v["name"] for k, v in here.items()}}
        problems.append("the frozen parameters differ: frozen in the checkpoint only: "
                        f"{sorted(names[k] for k in saved.keys() - here.keys()) or 'none'}; "
                        f"frozen in this engine only: {sorted(names[k] for k in here.keys() - saved.keys()) or 'none'}")
    for key in sorted(saved.keys() & here.keys(), key=int):
        a, b = saved[key], here[key]
        for field in ("shape", "dtype"):
            if a.get(field) != b[field]:
                problems.append(f"frozen parameter {b['name']!r} has {field} {a.get(field)} in the checkpoint, "
                                f"{b[field]} here")
                break
        else:
            if a.get("checksum") == b["checksum"] and a.get("crc") != b["crc"]:
                problems.append(f"frozen parameter {b['name']!r} has other values than the one the "
                                "checkpoint was saved on (checksum differs)")
    if problems:
        return [mf.first_few(problems, "; ") + ". A checkpoint saved with exclude_frozen_parameters=True "
                "resumes only on the same frozen base model: build the engine on the base it was trained on"]
    return []
