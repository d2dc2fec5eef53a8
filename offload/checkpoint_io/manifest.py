"""Where a checkpoint's files are, what its manifest says, and whether to trust it.

Note [checkpoint layout]
    save_dir/
      latest                    the newest complete tag (written last: temp + rename)
      <tag>/
        manifest.json           format, world size, the model's description, and every
                                file below with its size and checksum
        rank{r}/
          engine_state.json     counters, per-shard step counts, param groups, LR
                                scheduler, loss scaler, RNG states, configured
                                hyperparameters (Note [no code from a checkpoint])
          client_state.pt       client_state (read with torch.load(weights_only=True))
          state.safetensors     this rank's partitions on the device/host tiers:
                                param.{i} (compute dtype), master.{i}, exp_avg.{i},
                                exp_avg_sq.{i}, buffer.{name} (module buffers), and
                                grad.{i} when saved inside an accumulation window
          nvme/param.{i}.swp    NVMe-tier partitions: byte copies of the swap files
          nvme/optim.{i}.swp    (Note [swap file format] in offload/aio/swap_format.py);
          nvme/moments.{i}.swp  [exp_avg | exp_avg_sq] where param.{i} is the fp32 master
                                (Note [shared fp32 master] in offload/optim/states.py)
A save writes everything under `.<tag>.tmp/`, fsyncs the files and
directories, writes manifest.json, renames the directory to `<tag>` and only
then rewrites `latest`. A crash at any moment leaves `latest` naming a
complete checkpoint; a tag without manifest.json never exists under its
final name. Re-saving an existing tag moves the old one to `.<tag>.old`
first; a crash between the two renames is recovered on load (the old copy,
complete and verified, is used).

Note [manifest paths]
The manifest is read from the checkpoint, so it is untrusted input: every
file it lists must be one of the names above (rank{r}/... with r below the
saved world size), and must resolve inside the tag directory (a symlink
leading out is refused). Checked before any file it lists is opened or
stat'ed; errors name checkpoint-relative paths only, so a crafted manifest
can neither make a load read an outside file nor learn its size.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from offload.aio.checksum import ChecksumKind
from offload.checkpoint_io import files

FORMAT = "offload-checkpoint"
VERSION = 2  # 1: engine_state.pt was a pickle (Note [no code from a checkpoint])
MANIFEST = "manifest.json"
LATEST = "latest"
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")
# engine_state.pt: format version 1's (listed, checksummed by consolidation, never loaded).
_FILE = re.compile(r"^rank(0|[1-9][0-9]{0,5})/(engine_state\.json|engine_state\.pt|client_state\.pt|"
                   r"state\.safetensors|nvme/(param|optim|moments)\.(0|[1-9][0-9]{0,8})\.swp)$")
MAX_LISTED = 8  # problems of one kind named in an error before "and N more"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this engine."""


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag) or tag == LATEST or len(tag) > 200:
        raise ValueError(f"checkpoint tag {tag!r}: expected a plain directory name (letters, digits, "
                         f"'_', '-', '.', '+', '=', not starting with '.', not {LATEST!r})")
    return tag


def tmp_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.tmp"


def old_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.old"


def rank_dir(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rank{rank}"


def write_latest(root: Path, tag: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    files.write_bytes(tmp, (tag + "\n").encode())
    files.replace_durably(tmp, root / LATEST)


def describe_model(view) -> dict:
    """What a checkpoint must match to be loaded into this engine (and what consolidation needs)."""
    index_of = {id(s.param): s.index for s in view.shards}
    real_buffers = {name for name, _ in view.module.named_buffers()}
    state_dict, buffers = [], []
    for key, value in view.module.state_dict(keep_vars=True).items():
        if id(value) in index_of:
            state_dict.append([key, "param", index_of[id(value)]])
        elif key not in real_buffers:
            # A layer's own extra entries (a 4-bit weight's quantization state): made by the
            # layer from its frozen weight, constant, not saved (Note [quantized frozen weights]).
            state_dict.append([key, "derived", None])
        else:
            state_dict.append([key, "buffer", None])
            buffers.append({"name": key, "dtype": str(value.dtype).removeprefix("torch."),
                            "shape": list(value.shape)})
    return {
        "world_size": view.pg.world_size,
        "compute_dtype": str(view.compute_dtype).removeprefix("torch."),
        # Where the state was: informative (a run resumes into its own plan's tiers).
        "optimizer_tier": "/".join(sorted(t.value for t in view.optimizer.states.state_tiers)),
        # "state": None for a frozen parameter (Note [frozen parameters] in offload/placement.py).
        "parameters": [{"index": s.index, "name": s.name, "shape": list(s.shape),
                        "part_numel": s.part_numel, "home": s.home.value,
                        "state": view.optimizer.states.state_tier(s).value if s.trainable else None}
                       for s in view.shards],
        "buffers": buffers,
        "state_dict": state_dict,
    }


def mismatches(saved: dict, here: dict) -> list[str]:
    """Why a checkpoint described by `saved` cannot be loaded into `here` (empty: it can).
    The world size may differ: load re-partitions (Note [resuming at another world size])."""
    problems = []
    if saved["compute_dtype"] != here["compute_dtype"]:
        problems.append(f"precision mismatch: saved in {saved['compute_dtype']}, "
                        f"this engine computes in {here['compute_dtype']}")
    problems += _named_mismatches("parameter", saved["parameters"], here["parameters"])
    problems += _named_mismatches("buffer", saved["buffers"], here["buffers"])
    return problems


def _named_mismatches(what: str, saved: list[dict], here: list[dict]) -> list[str]:
    a = {e["name"]: e["shape"] for e in saved}
    b = {e["name"]: e["shape"] for e in here}
    out = []
    if a.keys() - b.keys():
        out.append(f"model mismatch: {what}s in the checkpoint but not in the model: "
                   f"{first_few(sorted(a.keys() - b.keys()))}")
    if b.keys() - a.keys():
        out.append(f"model mismatch: {what}s in the model but not in the checkpoint: "
                   f"{first_few(sorted(b.keys() - a.keys()))}")
    shapes = [f"{what} {name!r} has shape {a[name]} in the checkpoint, {b[name]} in the model"
              for name in a if name in b and a[name] != b[name]]  # in the model's order
    if shapes:
        out.append("model mismatch: " + first_few(shapes))
    if not out and [e["name"] for e in saved] != [e["name"] for e in here]:
        out.append(f"model mismatch: the {what}s are in a different order than in the checkpoint")
    return out


def first_few(items: list, sep: str = ", ") -> str:
    """The first MAX_LISTED of `items`, then how many more: an error stays readable."""
    shown = sep.join(str(i) for i in items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def resolve_tag_dir(root, tag: str | None) -> Path:
    """The directory of `tag` (or of the tag `latest` names), refusing what is not there."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root} is a file, not a checkpoint directory: give the directory "
                              "save_checkpoint wrote (its root, or one tag's directory)")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None and (root / MANIFEST).is_file():  # a tag's own directory
        return root
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"no '{LATEST}' file in {root}: no checkpoint was completed "
                                  f"there; pass tag= to load a specific one")
        tag = latest.read_text().strip()
    check_tag(tag)
    tag_dir = root / tag
    if tag_dir.is_dir():
        return tag_dir
    # Note [checkpoint layout]: a crash while re-saving the same tag.
    if (old_dir(root, tag) / MANIFEST).is_file():
        return old_dir(root, tag)
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    raise CheckpointError(f"checkpoint tag {tag!r} not found in {root} (tags there: {found})")


def read_manifest(tag_dir: Path, versions: tuple[int, ...] = (VERSION,)) -> dict:
    """The manifest, its format version one of `versions`, its file list checked
    (Note [manifest paths]) before anything it lists is touched."""
    path = tag_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"incomplete checkpoint {tag_dir}: no {MANIFEST} (was the save "
                              f"interrupted?)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt checkpoint {tag_dir}: {MANIFEST} is not valid JSON "
                              f"({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an offload checkpoint (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") not in versions:
        old = (" It was written by an older offload, whose engine_state.pt is a pickle, which is not "
               "loaded because unpickling can run code (Note [no code from a checkpoint]); its weights "
               "can still be taken out with `offload consolidate`" if manifest.get("version") == 1 else "")
        raise CheckpointError(f"{path}: checkpoint format version {manifest.get('version')!r}, this "
                              f"offload loads version {VERSION}.{old}")
    check_listed_files(tag_dir, manifest)
    return manifest


def check_listed_files(tag_dir: Path, manifest: dict) -> None:
    """Note [manifest paths]: names only, nothing opened or stat'ed but the tag directory's
    own path and symlinks inside it."""
    entries, model = manifest.get("files"), manifest.get("model")
    world = model.get("world_size") if isinstance(model, dict) else None
    if not isinstance(entries, dict) or not isinstance(world, int) or world < 1:
        raise CheckpointError(f"corrupt checkpoint {tag_dir}: {MANIFEST} has no valid file list or world size")
    bad = []
    for rel, entry in entries.items():
        match = _FILE.match(rel) if isinstance(rel, str) else None
        if match is None or int(match.group(1)) >= world:
            bad.append(repr(rel))
        elif not (isinstance(entry, dict) and all(isinstance(entry.get(k), int) and entry[k] >= 0
                                                  for k in ("bytes", "crc"))):
            bad.append(f"{rel!r} (no byte count and checksum)")
    if bad:
        raise CheckpointError(f"corrupt checkpoint {tag_dir}: {MANIFEST} lists files that are not files "
                              f"of a checkpoint of {world} rank(s): {first_few(bad)}; nothing was read")
    inside = os.path.realpath(tag_dir)
    escaping = [rel for rel in sorted(entries)
                if os.path.commonpath([inside, os.path.realpath(os.path.join(inside, rel))]) != inside]
    if escaping:
        raise CheckpointError(f"corrupt checkpoint {tag_dir}: files that lead outside the checkpoint "
                              f"(symbolic links): {first_few(escaping)}; nothing was read")


def verify_files(tag_dir: Path, manifest: dict, ranks) -> list[str]:
    """Checks size and checksum of every file of `ranks`, and the presence and size of all
    (paths checked already: read_manifest)."""
    problems = []
    kind_ = ChecksumKind[manifest["checksum"]]
    prefixes = tuple(f"rank{r}/" for r in ranks)
    for rel, entry in sorted(manifest["files"].items()):
        path = tag_dir / rel
        if not path.is_file():
            what = "is missing" if not os.path.lexists(path) else "is not a regular file"
            problems.append(f"corrupt checkpoint {tag_dir}: file {rel} {what}")
            continue
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            problems.append(f"corrupt checkpoint {tag_dir}: file {rel} has {size} bytes, "
                            f"the manifest says {entry['bytes']}")
            continue
        if rel.startswith(prefixes):
            _, crc = files.file_checksum(path, kind_)
            if crc != entry["crc"]:
                problems.append(f"corrupt checkpoint {tag_dir}: file {rel} fails its "
                                f"{kind_.name} check (stored {entry['crc']:#010x}, "
                                f"read {crc:#010x})")
    return problems


def load_verified(root, tag: str | None, here: dict | None, ranks,
                  versions: tuple[int, ...] = (VERSION,)) -> tuple[Path, dict]:
    """Resolves, reads and verifies a checkpoint; raises CheckpointError naming every problem."""
    tag_dir = resolve_tag_dir(root, tag)
    manifest = read_manifest(tag_dir, versions)
    problems = mismatches(manifest["model"], here) if here is not None else []
    if not problems:
        problems = verify_files(tag_dir, manifest, ranks)
    if problems:
        raise CheckpointError("cannot load checkpoint: " + "; ".join(problems))
    return tag_dir, manifest
