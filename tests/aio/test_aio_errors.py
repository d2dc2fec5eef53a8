"""Every failure the I/O layer promises to report, each observed by the call
that waits on it and naming the path and operation."""
import errno
import os
import shutil
import subprocess
import uuid
import warnings

import pytest
import torch

import offload.aio as aio
from offload.aio import Backend
from offload.aio.swap_store import SwapStore
from offload.aio.swap_config import SwapConfig

BACKENDS = [pytest.param(b, id=b.value, marks=[pytest.mark.skip(reason=f"{b.value}: {r}")] if (
    r := aio.unavailable_reason(b)) else []) for b in (Backend.NATIVE, Backend.LIBAIO, Backend.THREADS)]
from tests.aio.tmpfs import IS_ROOT, mounted_tmpfs


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (root only): genuine ENOSPC from the kernel."""
    with mounted_tmpfs(tmp_path, "1m", "the injected ENOSPC tests cover this path") as mnt:
        yield mnt


# ------------------------------------------------------------ AsyncIO errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["pwrite", "pread"])
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_injected_completion_error_names_path_and_op(tmp_path, backend, op, err):
    path = tmp_path / "f.bin"
    data = aio.aligned_empty(4 << 16).fill_(1)
    with aio.AsyncIO(block_size=1 << 16, queue_depth=4, backend=backend) as io:
        io.sync_pwrite(data, path)
        io._inject_fault(op, err, after_units=2)  # the third block fails, mid-transfer
        req = io.pwrite(data, path) if op == "pwrite" else io.pread(data, path)
        with pytest.raises(aio.AioError) as info:
            req.wait()
        assert info.value.errno == err
        assert str(path) in str(info.value) and op in str(info.value)
        with pytest.raises(aio.AioError):  # the same error again, not a silent success
            req.wait()
        io._clear_faults()
        io.sync_pread(data, path)  # the engine is still usable


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_enospc_on_small_tmpfs(small_tmpfs, backend):
    path = small_tmpfs / "big.bin"
    with aio.AsyncIO(block_size=1 << 16, backend=backend) as io:
        with pytest.raises(aio.AioError) as info:
            io.sync_pwrite(aio.aligned_empty(4 << 20), path)
    assert info.value.errno == errno.ENOSPC
    assert "pwrite" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_file_fails_at_the_call(tmp_path, backend):
    with aio.AsyncIO(backend=backend) as io:
        with pytest.raises(aio.AioError) as info:
            io.pread(torch.empty(10), tmp_path / "nope.bin")
    assert info.value.errno == errno.ENOENT and "nope.bin" in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [100, 5000, 3 * 65536 + 10])
def test_short_file_is_truncated_error(tmp_path, backend, size):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * size)
    with aio.AsyncIO(block_size=1 << 16, backend=backend) as io:
        with pytest.raises(aio.TruncatedFileError) as info:
            io.sync_pread(torch.empty(size + 1, dtype=torch.uint8), path)
    assert f"file ends at byte {size}" in str(info.value)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] is not Backend.THREADS])
def test_explicit_backend_refuses_without_o_direct(tmp_path, backend):
    with aio.AsyncIO(backend=backend) as io:
        io._refuse_direct()
        with pytest.raises(aio.DirectIOUnsupportedError, match="O_DIRECT refused"):
            io.pwrite(torch.zeros(10), tmp_path / "x.bin")


def test_auto_falls_back_to_buffered_threads_warning_once(tmp_path, monkeypatch):
    monkeypatch.setattr(aio, "_warned_direct", set())
    src = torch.randint(0, 256, (70001,), dtype=torch.uint8)
    with aio.AsyncIO(backend="auto") as io:
        io._refuse_direct()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r1 = io.pwrite(src, tmp_path / "a.bin")
            r1.wait()
            io.pwrite(src, tmp_path / "b.bin").wait()
        if io.backend is Backend.THREADS:
            pytest.skip("auto already uses threads here: nothing to fall back from")
        assert r1.backend is Backend.THREADS
        assert len([w for w in caught if "O_DIRECT is refused" in str(w.message)]) == 1
        dst = torch.empty_like(src)
        io.sync_pread(dst, tmp_path / "b.bin")
    assert torch.equal(src, dst)


def test_ramfs_without_o_direct_uses_fallback(tmp_path, monkeypatch):
    """The real thing: ramfs has no direct I/O (tmpfs has it since Linux 6.6)."""
    if not IS_ROOT:
        pytest.skip("mounting ramfs needs root; the injected refusal test covers this path")
    mnt = tmp_path / "ram"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mount -t ramfs not permitted here")
    try:
        probe = mnt / "probe"
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT))
            pytest.skip("this kernel's ramfs accepts O_DIRECT")
        except OSError:
            pass
        monkeypatch.setattr(aio, "_warned_direct", set())
        src = torch.randint(0, 256, (12345,), dtype=torch.uint8)
        with pytest.warns(RuntimeWarning, match="O_DIRECT is refused"):
            with aio.AsyncIO() as io:
                io.sync_pwrite(src, mnt / "x.bin")
                dst = torch.empty_like(src)
                io.sync_pread(dst, mnt / "x.bin")
        assert torch.equal(src, dst)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# --------------------------------------------------------- swap store errors


def _store(path, **kw):
    kw.setdefault("capacity_bytes", 1 << 20)
    kw.setdefault("buffer_bytes", 1 << 20)
    return SwapStore(SwapConfig(nvme_path=str(path), **kw))


def test_missing_nvme_path_is_created(tmp_path):
    store = _store(tmp_path / "a" / "b", rank=3)
    assert (tmp_path / "a" / "b" / "rank3").is_dir()
    store.close()


def test_nvme_path_that_is_a_file_fails_at_creation(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(aio.SwapStoreError, match="not a directory") as info:
        _store(f)
    assert info.value.errno == errno.ENOTDIR and str(f) in str(info.value)


def test_unwritable_nvme_path_fails_at_creation(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    (target / "rank0").mkdir()
    if IS_ROOT:  # root ignores mode bits: use a read-only mount instead
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target / "rank0")],
                          capture_output=True).returncode:
            pytest.skip("cannot make an unwritable directory as root here")
    else:
        os.chmod(target / "rank0", 0o500)
    try:
        with pytest.raises(aio.SwapStoreError, match="not writable") as info:
            _store(target)
        assert str(target / "rank0") in str(info.value)
    finally:
        if IS_ROOT:
            subprocess.run(["umount", str(target / "rank0")], check=False)
        else:
            os.chmod(target / "rank0", 0o700)


def test_too_small_fails_at_creation_with_the_numbers(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    need = free + (1 << 40)
    with pytest.raises(aio.SwapStoreError, match="too small") as info:
        _store(tmp_path, capacity_bytes=need)
    assert info.value.errno == errno.ENOSPC
    assert str(need) in str(info.value) and "are free" in str(info.value)


def test_swap_out_enospc_raises_and_leaves_no_valid_file(small_tmpfs):
    store = _store(small_tmpfs, capacity_bytes=256 << 10, buffer_bytes=8 << 20)
    store.swap_out("ok", torch.ones(1000)).wait()
    handle = store.swap_out("too-big", torch.ones(1 << 20))  # 4 MiB into a 1 MiB filesystem
    with pytest.raises(aio.AioError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOSPC and "pwrite" in str(info.value)
    assert any("too-big" in note for note in info.value.__notes__)
    assert sorted(os.listdir(store.directory)) == ["ok.swp"]
    assert torch.equal(store.swap_in("ok").wait(), torch.ones(1000))
    store.close()


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_swap_out_injected_error_leaves_previous_version(tmp_path, err):
    store = _store(tmp_path, buffer_bytes=64 << 10)  # 1 MiB tensor streams in pieces
    old, new = torch.zeros(1 << 18), torch.ones(1 << 18)
    store.swap_out("w", old).wait()
    store._io._inject_fault("pwrite", err, after_units=1)
    with pytest.raises(aio.AioError) as info:
        store.swap_out("w", new).wait()
    assert info.value.errno == err and str(store.directory) in str(info.value)
    assert not [f for f in os.listdir(store.directory) if f.endswith(".tmp")]
    assert torch.equal(store.swap_in("w").wait(), old)  # never a half-written "w"
    store.close()


def test_swap_in_injected_eio(tmp_path):
    store = _store(tmp_path)
    store.swap_out("w", torch.randn(5000)).wait()
    store._io._inject_fault("pread", errno.EIO)
    with pytest.raises(aio.AioError) as info:
        store.swap_in("w").wait()
    assert info.value.errno == errno.EIO and "pread" in str(info.value)
    store.close()


@pytest.mark.parametrize("checksum", [True, False])
def test_truncated_swap_file_detected(tmp_path, checksum):
    store = _store(tmp_path, checksum=checksum)
    store.swap_out("w", torch.randn(100000)).wait()
    os.truncate(store.path_of("w"), 50000)
    with pytest.raises(aio.TruncatedFileError, match="file ends at byte 50000"):
        store.swap_in("w").wait()
    store.close()


def test_corrupted_data_detected_by_checksum(tmp_path):
    store = _store(tmp_path, checksum=True)
    store.swap_out("w", torch.randn(100000)).wait()
    with open(store.path_of("w"), "r+b") as f:
        f.seek(4096 + 12345)
        byte = f.read(1)
        f.seek(4096 + 12345)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(aio.CorruptFileError, match="CRC32C? mismatch"):
        store.swap_in("w").wait()
    store.close()


def test_corrupted_header_detected_without_data_checksum(tmp_path):
    store = _store(tmp_path, checksum=False)
    store.swap_out("w", torch.randn(1000)).wait()
    with open(store.path_of("w"), "r+b") as f:
        f.seek(20)
        f.write(b"\xff")
    with pytest.raises(aio.CorruptFileError, match="header checksum"):
        store.swap_in("w").wait()
    with open(store.path_of("w"), "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(aio.CorruptFileError, match="not an offload swap file"):
        store.swap_in("w").wait()
    store.close()


def test_unknown_key(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(KeyError, match=str(uuid.UUID(int=0))):
        store.swap_in(str(uuid.UUID(int=0)))
    store.close()


def test_in_place_swap_overwrites_the_same_file(tmp_path):
    """atomic=False (the engine's scratch swap): no temporary file, no rename."""
    store = _store(tmp_path, atomic=False)
    store.swap_out("w", torch.zeros(3001)).wait()
    inode = os.stat(store.path_of("w")).st_ino
    new = torch.arange(3001, dtype=torch.float32)
    store.swap_out("w", new).wait()
    assert os.stat(store.path_of("w")).st_ino == inode
    assert torch.equal(store.swap_in("w").wait(), new)
    store.close()


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_in_place_swap_failure_removes_the_file(tmp_path, err):
    """A failed in-place write cannot keep the old version: the file goes, and a
    read of the key fails clearly instead of returning half-written data."""
    store = _store(tmp_path, buffer_bytes=64 << 10, atomic=False)
    store.swap_out("w", torch.zeros(1 << 18)).wait()
    store._io._inject_fault("pwrite", err, after_units=1)
    with pytest.raises(aio.AioError) as info:
        store.swap_out("w", torch.ones(1 << 18)).wait()
    assert info.value.errno == err
    assert not store.path_of("w").exists()
    with pytest.raises(Exception, match="w"):
        store.swap_in("w").wait()
    store.close()
