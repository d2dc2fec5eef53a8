"""Tensors by key in files under `nvme_path/rank{r}/`, moved asynchronously.

    store = SwapStore(SwapConfig.for_tensors("/nvme", sizes, in_flight=2))
    h = store.swap_out("layer3.w", tensor)    # tensor may be reused at once
    ...
    t = store.swap_in("layer3.w").wait()

File layout: Note [swap file format] in offload/aio/swap_format.py; where
files may be created: Note [creating swap files] (offload/aio/swap_dir.py).

The store is driven by one thread. Transfers finish in submission order
(FIFO): a handle's wait() also finishes the transfers queued before it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from offload.aio import AsyncIO
from offload.aio.memory import ALIGN, byte_view, round_up
from offload.aio.buffer_pool import BufferPool
from offload.aio.checksum import ChecksumKind, checksum, default_kind
from offload.aio.errors import AioError, CorruptFileError, SwapStoreError
from offload.aio.swap_config import SwapConfig, SwapStats
from offload.aio.swap_handle import SwapHandle, _Piece
from offload.aio.swap_dir import create_exclusive, fsync_path, prepare_directory, unlink_quietly
from offload.aio.swap_format import HEADER_BYTES, SwapMeta, file_bytes, parse_header, parse_meta, write_header

def _quote(key: str) -> str:
    name = urllib.parse.quote(key, safe="") or "%00"
    if len(name) > 180:  # NAME_MAX is 255; the key itself is in the header
        name = name[:100] + "-" + hashlib.sha1(key.encode()).hexdigest()
    return name


# Note [swap data checksums]
# With `checksum` (the engine's stores: aio.verify_swap_checksums, on by
# default) every file's header holds a CRC-32C of its data, computed as the
# data goes out and verified when a read completes, before the handle returns
# the tensor: a flipped bit on disk fails the read (CorruptFileError naming the
# file and the key) instead of becoming a weight that the next checkpoint saves
# under a fresh checksum of its own. The native kernel runs at ~9 GB/s and
# releases the GIL (offload/aio/checksum.py); writes checksum the lent tensor
# on the optimizer thread, reads on the thread that waits, after the bytes
# landed. Cost on the GPT 67M NVMe step: benchmarks/RESULTS.md, "Swap checksums".
#
# Note [failed in-place writes]
# An in-place write (atomic=False) that fails has already overwritten part of
# the old file, so neither value is on disk. When the tensor was lent
# (borrow=True: every write of the engine's training step) the store keeps a
# copy of the value it was given, and the key stays readable from that copy;
# rewrite_unwritten() writes the copies again (the engine does so when a
# failed step is retried), a later successful write of the key drops it, and
# discard_unwritten() forgets them (load_checkpoint rewrites every key). The
# copies are host memory outside the staging budget: at most the values one
# failed step was writing. A staged write cannot be kept (its source was free
# to change as soon as swap_out returned): its file is removed and the key
# reads as missing.


class SwapStore:
    def __init__(self, config: SwapConfig, *, ledger=None):
        """ledger: charged the staging buffers' host bytes (see BufferPool)."""
        self.config = config
        self.directory = prepare_directory(config)
        self._io = AsyncIO(config=config.aio)
        self._pool = BufferPool(config.buffer_bytes, ledger=ledger)
        self._kind = default_kind() if config.checksum else ChecksumKind.NONE
        self._index: dict[str, SwapMeta] = {}
        self._unwritten: dict[str, tuple[SwapMeta, torch.Tensor]] = {}  # Note [failed in-place writes]
        self._paths: dict[str, Path] = {}
        self._checked_files: set[Path] = set()  # regular files a write may go to (Note [creating swap files])
        self._queue: deque[_Piece] = deque()
        self._busy_since = {"swap_out": 0.0, "swap_in": 0.0}  # Note: busy = any transfer of that kind open
        self._busy_count = {"swap_out": 0, "swap_in": 0}
        self.stats = SwapStats()

    @property
    def io(self) -> AsyncIO:
        """The AsyncIO moving this store's bytes: `io.config` is the AioConfig it runs
        with, `io.backend` the backend it chose."""
        return self._io

    # ---------------------------------------------------------------- paths

    def path_of(self, key: str) -> Path:
        path = self._paths.get(key)
        if path is None:  # made once per key: quoting and joining cost ~5 us a transfer
            path = self._paths[key] = self.directory / (_quote(key) + ".swp")
        return path

    def _tmp_of(self, key: str) -> Path:
        return self.directory / ("." + _quote(key) + ".swp.tmp")

    def __contains__(self, key: str) -> bool:
        return key in self._index or self.path_of(key).exists()

    # ------------------------------------------------------------- swap_out

    def swap_out(self, key: str, tensor: torch.Tensor, *, borrow: bool = False) -> SwapHandle:
        """Starts writing the tensor. By default its bytes are copied into
        staging buffers and the caller may modify or free it as soon as this
        returns. borrow=True lends the tensor instead (Note [direct transfers]):
        it must stay unchanged until the handle is finished."""
        if tensor.device.type != "cpu":
            raise ValueError(f"swap_out {key!r}: tensor must be on the CPU, got {tensor.device}")
        src = byte_view(tensor.contiguous())
        n = src.numel()
        meta = SwapMeta(n, tensor.dtype, tuple(tensor.shape))
        if self.config.atomic:
            tmp = self._tmp_of(key)
        else:
            # Overwritten in place; the key is unreadable until this write completes.
            tmp = self.path_of(key)
            self._index.pop(key, None)
        self._create(tmp)
        handle = SwapHandle(self, "swap_out", key, self.path_of(key))
        if borrow and not self.config.atomic:
            handle._source = (meta, tensor)
        self._opened(handle)
        crc = 0
        if borrow and _direct(src):
            crc = checksum(self._kind, src)
            buf = self._acquire(HEADER_BYTES)
            write_header(buf, key, meta, self._kind, crc)
            self._start(handle, "pwrite", buf, HEADER_BYTES, tmp, 0, None)
            self._start(handle, "pwrite", src, n, tmp, HEADER_BYTES, None, pooled=False)
            if round_up(n) > n:  # pad the file as a staged write would: readers read whole blocks
                pad = self._acquire(round_up(n) - n)
                pad.zero_()
                self._start(handle, "pwrite", pad, round_up(n) - n, tmp, HEADER_BYTES + n, None)
        elif file_bytes(n) <= self._pool.budget_bytes:  # one aligned write: header + data
            buf = self._acquire(file_bytes(n))
            buf[HEADER_BYTES:HEADER_BYTES + n].copy_(src)
            crc = checksum(self._kind, buf[HEADER_BYTES:HEADER_BYTES + n])
            write_header(buf[:HEADER_BYTES], key, meta, self._kind, crc)
            self._start(handle, "pwrite", buf, file_bytes(n), tmp, 0, None)
        else:  # larger than the budget: stream it through in pieces, header last
            chunk = max(ALIGN, self._pool.budget_bytes // 2 // ALIGN * ALIGN)
            for start in range(0, n, chunk):
                length = min(chunk, n - start)
                buf = self._acquire(round_up(length))
                buf[:length].copy_(src[start:start + length])
                crc = checksum(self._kind, buf[:length], crc)
                self._start(handle, "pwrite", buf, round_up(length), tmp, HEADER_BYTES + start, None)
            buf = self._acquire(HEADER_BYTES)
            write_header(buf, key, meta, self._kind, crc)
            self._start(handle, "pwrite", buf, HEADER_BYTES, tmp, 0, None)

        def publish():
            if self.config.durable:
                fsync_path(tmp)
            if tmp != handle.path:
                os.replace(tmp, handle.path)  # the file appears complete or not at all
            if self.config.durable:
                fsync_path(self.directory)
            self._index[key] = meta
            self._unwritten.pop(key, None)
            self.stats.bytes_written += n
            self.stats.swap_outs += 1

        return self._sealed(handle, publish)

    def _create(self, path: Path) -> None:
        """Note [creating swap files]: a file a write goes to is created here,
        O_EXCL | O_NOFOLLOW, mode 0600; the I/O backends then open it with
        O_NOFOLLOW. Where a file exists already (rewritten in place, or written
        by the other store over the same files, Note [one store per thread] in
        offload/engine/build.py) it must be a regular file: a symlink planted at
        the name is refused, never written through. In-place files are checked
        once per store; a temporary name, renamed away at each write, each time."""
        if path in self._checked_files:
            return
        try:
            create_exclusive(path)
        except FileExistsError:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                raise SwapStoreError(errno.ELOOP, f"swap file {path} is a symbolic link (to "
                                                  f"{os.readlink(path)}): refusing to write through it")
            if not stat.S_ISREG(st.st_mode):
                raise SwapStoreError(errno.EEXIST, f"swap file {path} exists and is not a regular file")
        except OSError as exc:
            raise SwapStoreError(exc.errno, f"cannot create swap file {path}: {exc.strerror}") from exc
        if not self.config.atomic:
            self._checked_files.add(path)

    # -------------------------------------------------------------- swap_in

    def swap_in(self, key: str, out: torch.Tensor | None = None) -> SwapHandle:
        """Starts reading the tensor stored under `key`; wait() returns it (in
        `out` when given, which must have the same number of bytes)."""
        path = self.path_of(key)
        held = self._unwritten.get(key)
        if held is not None:
            return self._from_memory(key, path, *held, out)
        meta = self._index.get(key) or self._read_meta(key, path)
        if out is None:
            out = torch.empty(meta.shape, dtype=meta.dtype)
        dst = byte_view(out)
        n = meta.nbytes
        if dst.numel() != n or not out.is_contiguous():
            raise ValueError(f"swap_in {key!r}: out must be contiguous with {n} bytes, got {dst.numel()}")
        handle = SwapHandle(self, "swap_in", key, path)
        self._opened(handle)
        state = {"crc": 0, "header": None}

        def take_header(buf):
            state["header"] = parse_header(buf[:HEADER_BYTES], path, key)

        def take_data(buf, start, length):
            dst[start:start + length].copy_(buf[:length])
            state["crc"] = checksum(state["header"][1], buf[:length], state["crc"])

        if _direct(dst):
            buf = self._acquire(HEADER_BYTES)
            self._start(handle, "pread", buf, HEADER_BYTES, path, 0, lambda b=buf: take_header(b))
            self._start(handle, "pread", dst, n, path, HEADER_BYTES,
                        lambda: state.update(crc=checksum(state["header"][1], dst)), pooled=False)
        elif file_bytes(n) <= self._pool.budget_bytes:
            buf = self._acquire(file_bytes(n))
            self._start(handle, "pread", buf, file_bytes(n), path, 0,
                        lambda b=buf: (take_header(b), take_data(b[HEADER_BYTES:], 0, n)))
        else:
            buf = self._acquire(HEADER_BYTES)
            self._start(handle, "pread", buf, HEADER_BYTES, path, 0, lambda b=buf: take_header(b))
            chunk = max(ALIGN, self._pool.budget_bytes // 2 // ALIGN * ALIGN)
            for start in range(0, n, chunk):
                length = min(chunk, n - start)
                buf = self._acquire(round_up(length))
                self._start(handle, "pread", buf, round_up(length), path, HEADER_BYTES + start,
                            lambda b=buf, s=start, k=length: take_data(b, s, k))

        def verify():
            stored_n, kind, stored_crc = state["header"]
            if stored_n != n:
                raise CorruptFileError(str(path), f"header says {stored_n} bytes, expected {n}")
            if kind is not ChecksumKind.NONE and state["crc"] != stored_crc:
                raise CorruptFileError(
                    str(path), f"{kind.name} mismatch for key {key!r}: stored {stored_crc:#010x}, data "
                    f"{state['crc']:#010x}; the file changed after it was written, and its data is not "
                    "used (Note [swap data checksums])")
            self.stats.bytes_read += n
            self.stats.swap_ins += 1
            return out

        return self._sealed(handle, verify)

    def _from_memory(self, key: str, path: Path, meta: SwapMeta, value: torch.Tensor,
                     out: torch.Tensor | None) -> SwapHandle:
        """A read of a key whose in-place write failed: from the copy kept (Note [failed in-place writes])."""
        if out is None:
            out = torch.empty(meta.shape, dtype=meta.dtype)
        if byte_view(out).numel() != meta.nbytes or not out.is_contiguous():
            raise ValueError(f"swap_in {key!r}: out must be contiguous with {meta.nbytes} bytes, "
                             f"got {byte_view(out).numel()}")
        handle = SwapHandle(self, "swap_in", key, path)
        self._opened(handle)

        def copy():
            byte_view(out).copy_(byte_view(value))
            self.stats.swap_ins += 1
            return out

        return self._sealed(handle, copy)

    @property
    def unwritten_keys(self) -> list[str]:
        """Keys whose last in-place write failed; their values are held in memory."""
        return list(self._unwritten)

    def rewrite_unwritten(self) -> None:
        """Writes again every value whose in-place write failed (Note [failed in-place
        writes]); raises the first error, and keeps the values not written."""
        self.wait_all()
        handles = [self.swap_out(key, value, borrow=True) for key, (_, value) in list(self._unwritten.items())]
        error = None
        for handle in handles:
            try:
                handle.wait()
            except OSError as exc:
                error = error or exc
        if error is not None:
            raise error

    def discard_unwritten(self) -> None:
        """Forgets the values kept from failed writes (every key is about to be rewritten)."""
        self._unwritten.clear()

    def _read_meta(self, key: str, path: Path) -> SwapMeta:
        """Metadata of a file written by an earlier store (not in the index)."""
        if not path.exists():
            raise KeyError(f"swap_in: no tensor stored under {key!r} ({path} does not exist)")
        buf = self._acquire(HEADER_BYTES)
        try:
            self._io.sync_pread(buf[:HEADER_BYTES], path, 0)
            return parse_meta(buf, path, key)
        finally:
            self._pool.release(buf)

    # ------------------------------------------------------------ machinery

    def _acquire(self, nbytes: int) -> torch.Tensor:
        """A whole pool buffer of at least `nbytes`; while the budget is in
        use, finishes the oldest transfer to free one (never fails for want
        of buffers)."""
        while True:
            buf = self._pool.try_acquire(nbytes)
            if buf is not None:
                self.stats.buffer_peak_bytes = self._pool.peak_in_use_bytes
                return buf
            self._finish_through(self._queue[0].handle, upto_piece=self._queue[0])

    def _start(self, handle: SwapHandle, op: str, buf, nbytes: int, path: Path, offset: int,
               after, pooled: bool = True) -> None:
        """Starts moving buf[:nbytes]; a pooled `buf` goes back to the pool when it is finished
        (an unpooled one is the caller's tensor, lent for the transfer)."""
        handle._pieces_left += 1
        try:
            request = (self._io.pwrite if op == "pwrite" else self._io.pread)(buf[:nbytes], path, offset)
        except AioError as exc:  # failed at submit (open): recorded like any completion error
            request = _Failed(exc)
        self._queue.append(_Piece(handle, request, buf if pooled else None, after))

    def _finish_through(self, handle: SwapHandle, upto_piece: _Piece | None = None) -> None:
        """Finishes queued pieces in order until `handle` (or just `upto_piece`) is done."""
        t0 = time.perf_counter()
        try:
            while self._queue:
                piece = self._queue.popleft()
                self._finish_piece(piece)
                if piece is upto_piece or (upto_piece is None and piece.handle is handle
                                           and handle._finished):
                    return
        finally:
            self.stats.waited_seconds += time.perf_counter() - t0

    def _finish_piece(self, piece: _Piece) -> None:
        h = piece.handle
        try:
            piece.request.wait()
            if h._error is None and piece.after is not None:
                piece.after()
        except (OSError, ValueError) as exc:
            if h._error is None:
                h._error = exc
        except BaseException as exc:  # Ctrl-C in a callback: this handle fails, the interrupt goes on
            if h._error is None:  # later waits on it raise this, not the interrupt again
                h._error = InterruptedError(f"{h.op} of {h.key!r} interrupted ({type(exc).__name__})")
                h._interrupt = exc  # except in cleanup while it propagates (SwapHandle._raise_error)
            raise
        finally:
            # The pool buffer is only its own again when the kernel is done with it.
            if piece.buffer is not None:
                self._pool.release(piece.buffer)
            h._pieces_left -= 1
            if h._pieces_left == 0 and not h._open:
                self._complete(h)

    def _opened(self, handle: SwapHandle) -> None:
        op = handle.op
        if self._busy_count[op] == 0:
            self._busy_since[op] = time.perf_counter()
        self._busy_count[op] += 1

    def _sealed(self, handle: SwapHandle, finish: Callable[[], object]) -> SwapHandle:
        """Every piece of `handle` is queued; complete it now if they are all done."""
        handle._finish = finish
        handle._open = False
        if handle._pieces_left == 0:
            self._complete(handle)
        return handle

    def _complete(self, h: SwapHandle) -> None:
        self._busy_count[h.op] -= 1
        if self._busy_count[h.op] == 0:
            elapsed = time.perf_counter() - self._busy_since[h.op]
            if h.op == "swap_out":
                self.stats.write_seconds += elapsed
            else:
                self.stats.read_seconds += elapsed
        try:
            if h._error is None:
                h._result = h._finish()
        except (OSError, ValueError) as exc:
            h._error = exc
        if h._error is not None:
            h._error.add_note(f"while {h.op} of key {h.key!r}")
            if h.op == "swap_out" and h._source is not None:
                # Note [failed in-place writes]: the value stays readable from a copy
                # (the one kept already, when this was its rewrite).
                meta, value = h._source
                held = self._unwritten.get(h.key)
                self._unwritten[h.key] = (meta, value if held is not None and held[1] is value
                                          else value.detach().clone())
                h._error.add_note(f"its value is kept in memory until a rewrite of {h.key!r} succeeds")
            elif h.op == "swap_out":
                # Never leave a half-written file behind (in place: the key's own file).
                self._unwritten.pop(h.key, None)
                unlink_quietly(self._tmp_of(h.key) if self.config.atomic else h.path)
                self._checked_files.discard(h.path)  # gone: the next write creates it again (O_EXCL)
        # The lent tensor is the caller's again: a finished handle that its owner
        # keeps a while (a deque of writes, say) must not keep the tensor alive too
        # (it did: peak RSS of an NVMe step 2x, tests/engine/test_memory.py).
        h._source = None
        h._finished = True

    def wait_all(self) -> None:
        """Finishes every transfer; raises the first error among them."""
        handles = []
        while self._queue:
            piece = self._queue.popleft()
            handles.append(piece.handle)
            self._finish_piece(piece)
        for h in handles:
            h._raise_error()

    def trim(self) -> None:
        """Frees the staging buffers the pool keeps idle for reuse (after a
        burst of staged transfers, such as the first write of every tensor)."""
        self._pool.clear()

    def remove(self, key: str) -> None:
        self._index.pop(key, None)
        self._unwritten.pop(key, None)
        self._checked_files.discard(self.path_of(key))
        unlink_quietly(self.path_of(key))

    def close(self) -> None:
        while self._queue:
            self._finish_piece(self._queue.popleft())
        self._io.close()
        self._pool.clear()

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _direct(data: torch.Tensor) -> bool:
    """Note [direct transfers]: a tensor whose memory is 4096-aligned (from
    offload.aio.aligned_empty) moves between disk and its own memory with no
    staging copy: O_DIRECT for its aligned blocks, a buffered fragment for an
    unaligned tail. Small tensors are staged anyway: one 4 KiB copy is cheaper
    than a second request."""
    return data.numel() >= ALIGN and data.data_ptr() % ALIGN == 0


class _Failed:
    """A request that failed when submitted; behaves like a completed one."""

    def __init__(self, exc: AioError):
        self._exc = exc

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        raise self._exc
