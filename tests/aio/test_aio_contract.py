"""One contract, every backend present: exact round trips at adversarial sizes
and offsets, aligned and unaligned memory, async requests, parallelism."""
import os

import pytest
import torch

import offload.aio as aio
from offload.aio import Backend

BLOCK = 1 << 16  # small blocks so "many blocks + odd tail" stays fast


def _backend_params():
    params = []
    for b in (Backend.NATIVE, Backend.LIBAIO, Backend.THREADS):
        reason = aio.unavailable_reason(b)
        marks = [pytest.mark.skip(reason=f"{b.value}: {reason}")] if reason else []
        params.append(pytest.param(b, marks=marks, id=b.value))
    return params


@pytest.fixture(params=_backend_params())
def io(request):
    with aio.AsyncIO(block_size=BLOCK, queue_depth=8, intra_op_parallelism=2, backend=request.param) as io:
        yield io


def _random_bytes(n, aligned):
    if aligned:
        t = aio.aligned_empty(n)
        t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        return t
    # One byte into an allocation: the address is not 4096-aligned.
    return torch.randint(0, 256, (n + 1,), dtype=torch.uint8)[1:]


# The exact multiples (a page, a block) are the easy case: the fast part keeps the sizes around them.
SIZES = [1, 4095, pytest.param(4096, marks=pytest.mark.slow), 4097,
         BLOCK - 1, pytest.param(BLOCK, marks=pytest.mark.slow), BLOCK + 1, 5 * BLOCK + 4097]


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
# The fast part: file offsets 0 and 5000 (not a page multiple).
@pytest.mark.parametrize("offset", [0, pytest.param(4096, marks=pytest.mark.slow), 5000])
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_exact(io, tmp_path, n, offset, aligned):
    path = tmp_path / "f.bin"
    src = _random_bytes(n, aligned)
    assert io.sync_pwrite(src, path, offset) == n
    assert os.path.getsize(path) == offset + n
    dst = _random_bytes(n, not aligned)
    assert io.sync_pread(dst, path, offset) == n
    assert torch.equal(src, dst)


def test_write_into_middle_keeps_neighbours(io, tmp_path):
    path = tmp_path / "f.bin"
    base = _random_bytes(3 * BLOCK + 123, aligned=True)
    io.sync_pwrite(base, path)
    patch = _random_bytes(BLOCK + 7, aligned=False)
    io.sync_pwrite(patch, path, 1000)
    expect = base.clone()
    expect[1000:1000 + patch.numel()] = patch
    got = torch.empty_like(base)
    io.sync_pread(got, path)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_dtypes_and_shapes(io, tmp_path, dtype):
    src = torch.randn(37, 129).to(dtype)
    path = tmp_path / "t.bin"
    io.sync_pwrite(src, path)
    dst = torch.empty_like(src)
    io.sync_pread(dst, path)
    assert torch.equal(src, dst)


def test_many_async_requests_then_wait(io, tmp_path):
    srcs = [_random_bytes(n, aligned=i % 2 == 0) for i, n in enumerate([4097, BLOCK * 3 + 1, 1, 12345] * 3)]
    reqs = [io.pwrite(s, tmp_path / f"{i}.bin") for i, s in enumerate(srcs)]
    for r in reqs:
        r.wait()
        assert r.done()
    dsts = [torch.empty_like(s) for s in srcs]
    reqs = [io.pread(d, tmp_path / f"{i}.bin") for i, d in enumerate(dsts)]
    for r in reqs:
        r.wait()
        r.wait()  # idempotent
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_one_file_many_slices(io, tmp_path):
    path = tmp_path / "f.bin"
    chunks = [_random_bytes(n, aligned=False) for n in (4096, 1, 8191, BLOCK + 3)]
    offsets, pos = [], 0
    for c in chunks:
        offsets.append(pos)
        pos += c.numel()
    for r in [io.pwrite(c, path, o) for c, o in zip(chunks, offsets)]:
        r.wait()
    for c, o in zip(chunks, offsets):
        d = torch.empty_like(c)
        io.sync_pread(d, path, o)
        assert torch.equal(c, d)


def test_empty_tensor(io, tmp_path):
    path = tmp_path / "empty.bin"
    io.sync_pwrite(torch.empty(0), path)
    assert path.exists() and os.path.getsize(path) == 0
    io.sync_pread(torch.empty(0), path)


def test_rejects_bad_tensors(io, tmp_path):
    with pytest.raises(ValueError, match="contiguous"):
        io.pwrite(torch.randn(8, 8).t(), tmp_path / "x")
    with pytest.raises(ValueError, match="offset"):
        io.pwrite(torch.randn(8), tmp_path / "x", -1)


def test_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        aio.AsyncIO(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        aio.AsyncIO(queue_depth=0)
    with pytest.raises(ValueError, match="aio.backend: 'spdk' is not one of auto"):
        aio.AsyncIO(backend="spdk")
    with pytest.raises(TypeError, match="thread_count"):  # the config layer maps DeepSpeed's name
        aio.AioConfig(thread_count=4)


def test_backend_report_lists_every_backend():
    report = aio.backend_report()
    assert set(report) == {"native", "libaio", "threads", "auto"}
    assert report["threads"] == "available"
    assert report["auto"].startswith("uses ")


@pytest.mark.parametrize("n", [(2 << 20) - 1, 2 << 20, (2 << 20) + 4097, 5 * (2 << 20) + 1])
def test_large_aligned_buffers_are_their_own_mappings_and_hold_their_bytes(n):
    """Note [huge pages for swap buffers]: 2 MiB and more come from a mapping
    of their own, still 4096-aligned, exactly n bytes long, and writable."""
    t = aio.aligned_empty(n, pin=False)
    assert t.numel() == n and t.dtype == torch.uint8 and t.data_ptr() % 4096 == 0
    values = torch.randint(0, 256, (n,), dtype=torch.uint8)
    t.copy_(values)
    assert torch.equal(t, values)
    as_float = aio.aligned_tensor(n // 4, torch.float32, pin=False)
    assert as_float.numel() == n // 4 and as_float.data_ptr() % 4096 == 0


def test_a_mapping_the_kernel_refuses_is_a_memory_error_naming_the_size(monkeypatch):
    import errno
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match=r"could not map 8388608 bytes \(8.0 MiB\).*Cannot allocate memory"):
        aio.aligned_empty(8 << 20, pin=False)
