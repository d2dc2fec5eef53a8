"""The directory a swap store writes in, and how its files are created.

The engine gives each run a directory of its own (Note [run directories] in
offload/aio/run_dir.py); here a store checks that directory and creates its
files without following links (Note [creating swap files], swap_store.py).
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from offload.aio.errors import SwapStoreError
from offload.aio.memory import ALIGN


def prepare_directory(config) -> Path:
    """Creates nvme_path/rank{r}/ (mode 0700) and checks it is a writable
    directory of this user's own (Note [creating swap files]) with room for
    capacity_bytes, so a bad path fails here, not mid-step. The engine gives a
    directory of the run's own as nvme_path (Note [run directories] in
    offload/aio/run_dir.py)."""
    root = Path(config.nvme_path)
    if root.exists() and not root.is_dir():
        raise SwapStoreError(errno.ENOTDIR, f"nvme_path {root} exists and is not a directory")
    directory = root / f"rank{config.rank}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise SwapStoreError(exc.errno, f"cannot create swap directory {directory}: {exc.strerror}") from exc
    check_own_directory(directory, check_mode=False)  # nothing written through a link
    probe = directory / f".probe-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"\0" * ALIGN)
        finally:
            os.close(fd)
    except OSError as exc:
        raise SwapStoreError(exc.errno, f"nvme_path {directory} is not writable: {exc.strerror}") from exc
    finally:
        unlink_quietly(probe)
    check_own_directory(directory, check_mode=True)  # after the probe: a read-only mount says so first
    free = shutil.disk_usage(directory).free
    reusable = sum(p.lstat().st_size for p in directory.glob("*.swp"))  # replaced as keys are rewritten
    if free + reusable < config.capacity_bytes:
        gib = 2 ** 30
        raise SwapStoreError(
            errno.ENOSPC,
            f"nvme_path {directory} is too small: the store needs {config.capacity_bytes} bytes "
            f"({config.capacity_bytes / gib:.2f} GiB) but {free} bytes ({free / gib:.2f} GiB) are free "
            f"and {reusable} bytes are held by files it would replace",
        )
    return directory


def check_own_directory(directory: Path, *, check_mode: bool) -> None:
    """Swap data goes only into a real directory of this user's that no one else
    can write to: a symlink, another user's directory or a shared one is
    refused, never adopted (Note [creating swap files])."""
    st = os.lstat(directory)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = f"is a symbolic link (to {os.readlink(directory)})"
    elif not stat.S_ISDIR(st.st_mode):
        why = "exists and is not a directory"
    elif st.st_uid != os.geteuid():
        why = f"belongs to another user (uid {st.st_uid})"
    elif check_mode and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if why is not None:
        err = errno.ENOTDIR if "not a directory" in why else errno.EPERM
        raise SwapStoreError(err, f"swap directory {directory} {why}: refusing to put swap files there")


def create_exclusive(path: Path) -> None:
    """Creates an empty swap file where nothing exists yet (O_EXCL, O_NOFOLLOW):
    a file, or a symlink, planted at the name fails the call rather than being
    written through (Note [creating swap files])."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, OSError):  # gone already, or a read-only probe that never existed
        pass
