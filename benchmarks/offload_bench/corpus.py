"""A byte-level text corpus every machine has: the running Python's standard library sources.

    data = load_corpus(max_bytes=4 << 20)          # uint8 tensor, deterministic
    train, val = split_corpus(data, val_fraction=0.05)   # 5% held out, from 20 places
    sampler = BatchSampler(train, batch_size=8, seq_len=128, seed=0)
    inputs, targets = sampler.sample()              # int64 (8, 128) each, targets = inputs shifted by one

The files are the `*.py` files under `sysconfig.get_paths()["stdlib"]`
(site-packages and dist-packages excluded), read in sorted order of their
relative POSIX paths and concatenated, so the same Python gives the same bytes
on every machine. Tokens are bytes: a vocabulary of 256, nothing to download.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

__all__ = [
    "VOCAB_SIZE",
    "StdlibSourcesNotFound",
    "BatchSampler",
    "load_corpus",
    "split_corpus",
    "stdlib_files",
    "stdlib_path",
]

VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class StdlibSourcesNotFound(FileNotFoundError):
    """The standard library's .py sources are not on this machine (some distros strip them)."""


def stdlib_path() -> Path:
    """Where the running Python's standard library lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The *.py files under `root` (default: the stdlib), sorted by relative POSIX path."""
    root = stdlib_path() if root is None else Path(root)
    if not root.is_dir():
        raise StdlibSourcesNotFound(
            f"Python standard library sources not found: {str(root)!r} is not a directory "
            f"(searched sysconfig.get_paths()['stdlib']); install your distribution's full Python "
            f"package (for example python3-dev / libpython3-stdlib) or pass another root")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise StdlibSourcesNotFound(
            f"Python standard library sources not found: no *.py files under {str(root)!r} "
            f"(searched sysconfig.get_paths()['stdlib']; some distributions ship only .pyc files); "
            f"install your distribution's Python source package or pass another root")
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def load_corpus(max_bytes: int = 4 << 20, root: str | os.PathLike | None = None) -> torch.Tensor:
    """The stdlib sources concatenated, at most `max_bytes` bytes, as a 1-D uint8 tensor."""
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be at least 2, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_files(root):
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file (permissions, a dangling link): skip it
            continue
        chunks.append(data[:max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 2:
        raise StdlibSourcesNotFound(f"the *.py files under {str(root or stdlib_path())!r} are empty")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def split_corpus(data: torch.Tensor, val_fraction: float = 0.05,
                 blocks: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the corpus cut into `blocks` equal blocks, the last `val_fraction` of
    each held out. With blocks=1 that is simply the last `val_fraction` of the bytes; with
    several, the held-out bytes come from all over the (sorted) corpus instead of only its
    last files, so the validation loss measures the same kind of text as the training.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    n = data.numel()
    blocks = max(1, min(blocks, n // 4))
    if n < 4:
        raise ValueError(f"a corpus of {n} bytes is too small to split")
    bounds = [n * i // blocks for i in range(blocks + 1)]
    train_parts, val_parts = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        cut = end - max(1, min(end - start - 1, round((end - start) * val_fraction)))
        train_parts.append(data[start:cut])
        val_parts.append(data[cut:end])
    return torch.cat(train_parts), torch.cat(val_parts)


class BatchSampler:
    """Random windows of `seq_len + 1` bytes; inputs are the first seq_len, targets the last.

    Deterministic: the windows depend only on `seed` and the number of batches drawn.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0):
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if data.numel() < seq_len + 1:
            raise ValueError(f"data has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        high = self.data.numel() - self.seq_len  # starts in [0, high): window fits
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        windows = self.data[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self):
        while True:
            yield self.sample()
