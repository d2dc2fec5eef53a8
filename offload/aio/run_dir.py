"""A run's own swap directory under `nvme_path`, and the removal of those dead runs left.

    run_dirs = RunDirectories()
    path = run_dirs.open("/nvme").path   # /nvme/offload-<host>-<pid>-<random>/
    ...                                  # stores write under path/rank{r}/
    run_dirs.remove()                    # also at exit and on a fatal signal

Note [run directories]
Every process that swaps to `nvme_path` works in a directory of its own,
`nvme_path/offload-<host>-<pid>-<random>/`, which it creates (mkdir, mode 0700;
an existing one is never adopted) and marks in this order:
  1. `.lock`, created O_EXCL, flock(LOCK_EX) held until the directory is removed;
  2. `.offload-run`, JSON {"pid", "host", "started"}: the marker that says the
     directory is one of ours and whose it is.
A directory without the marker is never touched (it is not ours, or its owner
is between steps 1 and 2 and holds the lock). Two jobs on one `nvme_path` so
never meet: each has its own files, and one's close() cannot remove the
other's (before: both used `nvme_path/rank0`; job A ended with job B's weights,
and B died with ENOENT when A closed).

When it opens a directory under `nvme_path`, a process first removes the
stale ones there: marked, owned by this user, made on this host by a process
that is gone, and with the lock free (a live owner, or a child it forked,
holds it). Each removal is logged with its path and bytes. Directories from
another host are left alone: whether their owner lives cannot be known here,
and flock is not shared across hosts on every network file system.

Removal (the marker first, so no cleaner takes the directory for stale while
it goes, then the files, then the lock) happens at `remove()`, when the
object is collected, at interpreter exit (weakref.finalize), and on SIGTERM or
SIGHUP whose action is the default one (termination): the handler removes
the directories, restores the default action and sends the signal again, so
the process still dies of it. SIGINT, and any signal with a Python handler,
is left to that handler: Python's SIGINT raises KeyboardInterrupt, which
unwinds to the caller; a script that catches it may save a checkpoint from the
swap files or train on, and one that does not exits through the exit path
above. After kill -9 the files stay until the next run on that `nvme_path`.
A forked child inherits none of this: only the creating process removes.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
import weakref
from pathlib import Path

from offload.aio.errors import SwapStoreError

log = logging.getLogger("offload")

PREFIX = "offload-"
MARKER = ".offload-run"
LOCK = ".lock"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class RunDirectory:
    """One process's own directory under a swap root (Note [run directories]).
    `path` is where its stores write; the lock is held until remove()."""

    def __init__(self, root):
        """Removes the stale directories under `root`, then makes this run's."""
        root = Path(os.path.abspath(os.fspath(root)))  # removed by path, maybe after a chdir
        made = _check_root(root)  # the folders of nvme_path this run made: removed with it, if empty
        remove_stale(root)
        self.root = root
        host, pid = socket.gethostname(), os.getpid()
        # A host name may hold characters a file name should not; the marker has it verbatim.
        safe_host = "".join(c if c.isalnum() or c in "-_." else "_" for c in host)[:64]
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                while True:
                    name = f"{PREFIX}{safe_host}-{pid}-{secrets.token_hex(4)}"
                    try:
                        os.mkdir(name, 0o700, dir_fd=root_fd)  # fails on any existing name: never adopted
                        break
                    except FileExistsError:
                        continue
                dir_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
            finally:
                os.close(root_fd)
        except OSError as exc:
            raise SwapStoreError(exc.errno, f"cannot create a swap directory in nvme_path {root}: "
                                            f"{exc.strerror}") from exc
        self.path = root / name
        lock_fd = None
        try:
            os.fchmod(dir_fd, 0o700)  # mkdir's mode passed through the umask
            lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=dir_fd)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            marker = json.dumps({"pid": pid, "host": host, "started": time.time()}).encode()
            fd = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=dir_fd)
            try:
                os.write(fd, marker)
            finally:
                os.close(fd)
        except BaseException as exc:  # Ctrl-C included: an unmarked directory would never be cleaned
            if lock_fd is not None:
                os.close(lock_fd)
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(exc, OSError):
                raise SwapStoreError(exc.errno, f"cannot set up the swap directory {self.path}: "
                                                f"{exc.strerror}") from exc
            raise
        finally:
            os.close(dir_fd)
        self._finalizer = _LIVE[self.path] = weakref.finalize(self, _remove, self.path, lock_fd, pid, made)
        _install_signal_handlers()

    @property
    def removed(self) -> bool:
        return not self._finalizer.alive

    def remove(self) -> None:
        """Removes the directory and every file in it, then releases the lock. Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"RunDirectory({str(self.path)!r}{', removed' if self.removed else ''})"


class RunDirectories:
    """The run directories of one engine (or offload.init builder), one per nvme_path:
    every store on one nvme_path shares its files (Note [one store per thread])."""

    def __init__(self):
        self._by_root: dict[str, RunDirectory] = {}

    def open(self, nvme_path) -> RunDirectory:
        key = os.path.realpath(os.fspath(nvme_path))
        run_dir = self._by_root.get(key)
        if run_dir is None:
            run_dir = self._by_root[key] = RunDirectory(nvme_path)
        return run_dir

    def take(self, other: "RunDirectories") -> None:
        """Takes over `other`'s directories (initialize adopting offload.init's store)."""
        self._by_root.update(other._by_root)
        other._by_root = {}

    def paths(self) -> list[Path]:
        return [d.path for d in self._by_root.values()]

    def remove(self) -> None:
        for run_dir in self._by_root.values():
            run_dir.remove()
        self._by_root = {}


# ------------------------------------------------------------------ removal


def _remove(path: Path, lock_fd: int, owner_pid: int, made: tuple = ()) -> None:
    """The finalizer: no reference to the RunDirectory, so it can run at its collection.
    made: the folders of nvme_path the run made, deepest first: each removed while empty
    (another run's directory, or a user's file, keeps it)."""
    _LIVE.pop(path, None)
    if os.getpid() != owner_pid:  # a forked child: the directory is its parent's
        return
    try:
        os.unlink(path / MARKER)  # first: from here no cleaner takes it for stale
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            break


_LIVE: dict[Path, weakref.finalize] = {}  # each live directory's removal, for the signal handler


def remove_stale(root: Path) -> list[tuple[Path, int]]:
    """Removes the directories under `root` that dead runs on this host left
    (Note [run directories]); returns (path, bytes) of each, and logs them."""
    removed = []
    host, uid = socket.gethostname(), os.geteuid()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            owner = read_marker(Path(entry.path))
            if owner is None or owner.get("host") != host or _alive(owner.get("pid")):
                continue
            lock_fd = _try_lock(Path(entry.path))
        except OSError:
            continue  # being removed by its owner or another cleaner, or not ours to read
        if lock_fd is None:
            continue
        try:
            nbytes = _tree_bytes(Path(entry.path))
            os.unlink(Path(entry.path) / MARKER)
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue
        finally:
            os.close(lock_fd)
        log.warning("offload: removed %s, the swap directory of a run that ended without removing it "
                    "(pid %s on %s): %d bytes", entry.path, owner.get("pid"), owner.get("host"), nbytes)
        removed.append((Path(entry.path), nbytes))
    return removed


def read_marker(directory: Path) -> dict | None:
    """The owner a run directory's marker names, or None where it has none (not ours)."""
    try:
        fd = os.open(directory / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        owner = json.loads(os.read(fd, 4096))
    except ValueError:
        return None
    finally:
        os.close(fd)
    return owner if isinstance(owner, dict) else None


def _try_lock(directory: Path) -> int | None:
    """The lock file's descriptor, locked; None where a live run holds it."""
    fd = os.open(directory / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    return fd


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unreadable: treated as alive, never removed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _check_root(root: Path) -> tuple:
    """nvme_path must be a directory (made if missing) and not inside another run's directory;
    returns the folders made, deepest first."""
    if root.exists() and not root.is_dir():
        raise SwapStoreError(errno.ENOTDIR, f"nvme_path {root} exists and is not a directory")
    for directory in (root.resolve(), *root.resolve().parents):
        owner = read_marker(directory)
        if owner is None:
            continue
        live = _held(directory)
        whose = f"pid {owner.get('pid')} on {owner.get('host')}"
        raise SwapStoreError(
            errno.EBUSY if live else errno.EINVAL,
            f"nvme_path {root} is inside {directory}, the swap directory of "
            + (f"a live run ({whose}), in use by it" if live else f"an ended run ({whose})")
            + f"; give a directory of your own (for example {directory.parent})")
    missing, folder = [], root
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SwapStoreError(exc.errno, f"cannot create nvme_path {root}: {exc.strerror}") from exc
    return tuple(missing)


def _held(directory: Path) -> bool:
    try:
        fd = _try_lock(directory)
    except OSError:
        return True  # cannot tell: say it may be in use
    if fd is None:
        return True
    os.close(fd)
    return False


# ------------------------------------------------------------------ signals

_INSTALLED: set[int] = set()
_FATAL = (signal.SIGTERM, signal.SIGHUP)


def _install_signal_handlers() -> None:
    """Where a signal's action is the default (termination), the run's
    directories are removed first (Note [run directories]). Only the main
    thread may install handlers; a run opened elsewhere relies on the exit path."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _FATAL:
        if signum in _INSTALLED:
            continue
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_fatal_signal)
            _INSTALLED.add(signum)


def _on_fatal_signal(signum, frame) -> None:
    for finalizer in list(_LIVE.values()):
        finalizer()
    # The default action, as if this handler had never been installed.
    signal.signal(signum, signal.SIG_DFL)
    _INSTALLED.discard(signum)
    os.kill(os.getpid(), signum)
