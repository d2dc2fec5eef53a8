"""Swap store: exact round trips, a buffer budget that is never exceeded and
never runs out, files readable by a later store, stats, and the checksum."""
import os
import zlib

import pytest
import torch

import offload.aio as aio
from offload import _native
from offload.aio.checksum import ChecksumKind, checksum
from offload.aio.swap_format import HEADER_BYTES, file_bytes
from offload.aio.swap_store import SwapStore
from offload.aio.swap_config import SwapConfig

BACKENDS = [b.value for b in aio.available_backends()]


def _store(path, **kw):
    kw.setdefault("capacity_bytes", 64 << 20)
    kw.setdefault("buffer_bytes", 4 << 20)
    return SwapStore(SwapConfig(nvme_path=str(path), **kw))


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "one": torch.randn(1, generator=g),
        "odd": torch.randn(1023, generator=g),
        "page": torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=g),
        "bf16": torch.randn(33, 77, generator=g).to(torch.bfloat16),
        "int": torch.randint(-9, 9, (5, 6, 7), dtype=torch.int64, generator=g),
        "big": torch.randn(600_001, generator=g),  # > 2 MiB: streams through a small budget
        "empty": torch.empty(0, 3),
        "layers.0/attn.q": torch.randn(64, 64, generator=g),  # a key with '/' and '.'
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [16 << 10, 4 << 20], ids=["tiny-budget", "roomy"])
@pytest.mark.parametrize("checksum_on", [False, True], ids=["nocrc", "crc"])
def test_round_trip_all_in_flight(tmp_path, backend, budget, checksum_on):
    ts = _tensors()
    store = _store(tmp_path, buffer_bytes=budget, checksum=checksum_on,
                   aio=aio.AioConfig(block_size=1 << 16, backend=backend))
    handles = [store.swap_out(k, t) for k, t in ts.items()]  # all queued before any wait
    for h in handles:
        assert h.wait() is None
    ins = {k: store.swap_in(k) for k in ts}
    for k, h in ins.items():
        got = h.wait()
        assert got.dtype == ts[k].dtype and got.shape == ts[k].shape
        assert torch.equal(got, ts[k]), k
    assert store.stats.buffer_peak_bytes <= budget
    assert store.stats.swap_outs == store.stats.swap_ins == len(ts)
    store.close()


def test_source_may_change_right_after_swap_out(tmp_path):
    store = _store(tmp_path)
    t = torch.arange(10000, dtype=torch.float32)
    h = store.swap_out("t", t)
    t.fill_(-1)  # the store took a copy
    h.wait()
    assert torch.equal(store.swap_in("t").wait(), torch.arange(10000, dtype=torch.float32))
    store.close()


def test_swap_in_into_out_and_overwrite(tmp_path):
    store = _store(tmp_path)
    store.swap_out("w", torch.zeros(300)).wait()
    store.swap_out("w", torch.full((300,), 7.0)).wait()
    out = torch.empty(300)
    assert store.swap_in("w", out=out).wait() is out
    assert torch.equal(out, torch.full((300,), 7.0))
    with pytest.raises(ValueError, match="1200 bytes"):
        store.swap_in("w", out=torch.empty(10))
    assert sorted(os.listdir(store.directory)) == ["w.swp"]
    assert os.path.getsize(store.path_of("w")) == file_bytes(1200) == HEADER_BYTES + 4096
    store.close()


def test_files_readable_by_a_new_store(tmp_path):
    ts = _tensors()
    with _store(tmp_path, checksum=True) as store:
        for k, t in ts.items():
            store.swap_out(k, t)
        store.wait_all()
    with _store(tmp_path) as store:  # no index: metadata comes from the headers
        for k, t in ts.items():
            assert k in store
            assert torch.equal(store.swap_in(k).wait(), t)


def test_ranks_are_separate_directories(tmp_path):
    a, b = _store(tmp_path, rank=0), _store(tmp_path, rank=1)
    a.swap_out("x", torch.zeros(3)).wait()
    b.swap_out("x", torch.ones(3)).wait()
    assert torch.equal(a.swap_in("x").wait(), torch.zeros(3))
    assert torch.equal(b.swap_in("x").wait(), torch.ones(3))
    assert (tmp_path / "rank0" / "x.swp").exists() and (tmp_path / "rank1" / "x.swp").exists()
    a.close()
    b.close()


def test_durable_mode_round_trips(tmp_path):
    with _store(tmp_path, durable=True, checksum=True) as store:
        store.swap_out("ckpt", torch.randn(5000)).wait()
        assert store.swap_in("ckpt").wait().numel() == 5000


def test_for_tensors_sizes_from_what_is_held(tmp_path):
    sizes = [4000, 1 << 20, 12]
    cfg = SwapConfig.for_tensors(tmp_path, sizes, in_flight=3)
    assert cfg.buffer_bytes == 3 * file_bytes(1 << 20)
    assert cfg.capacity_bytes == sum(file_bytes(n) for n in sizes) + file_bytes(1 << 20)


def test_stats_count_bytes_and_time(tmp_path):
    with _store(tmp_path) as store:
        store.swap_out("a", torch.randn(1 << 18)).wait()
        store.swap_in("a").wait()
        s = store.stats
        assert s.bytes_written == s.bytes_read == 1 << 20
        assert s.write_seconds > 0 and s.read_seconds > 0 and s.waited_seconds >= 0
        assert s.write_gbps > 0 and s.read_gbps > 0


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="swap.buffer_bytes"):
        SwapConfig(nvme_path="/x", capacity_bytes=0, buffer_bytes=10)
    with pytest.raises(ValueError, match="swap.capacity_bytes"):
        SwapConfig(nvme_path="/x", capacity_bytes=-1, buffer_bytes=1 << 20)


# ------------------------------------------------------------------ checksum


@pytest.mark.skipif(not _native.available(), reason="native extension not built")
@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 4096, 100_003])
def test_crc32c_kernel_matches_reference(n):
    data = torch.randint(0, 256, (n + 3,), dtype=torch.uint8)[3:]  # unaligned start
    c = _native.native.aio
    assert c.crc32c(data.data_ptr(), n, 0) == c.crc32c_reference(data.data_ptr(), n, 0)
    half = n // 2
    chained = c.crc32c(data.data_ptr() + half, n - half, c.crc32c(data.data_ptr(), half, 0))
    assert chained == c.crc32c(data.data_ptr(), n, 0)


@pytest.mark.skipif(not _native.available(), reason="native extension not built")
def test_crc32c_check_value():
    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert checksum(ChecksumKind.CRC32C, data) == 0xE3069283  # the standard CRC-32C check value


def test_zlib_fallback_is_plain_crc32():
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    assert checksum(ChecksumKind.CRC32, data) == zlib.crc32(bytes(data.numpy()))


def _aligned(values: torch.Tensor) -> torch.Tensor:
    out = aio.aligned_empty(values.numel() * values.element_size()).view(values.dtype)
    return out.copy_(values.reshape(-1))


@pytest.mark.parametrize("backend", BACKENDS)
# The fast part: a tail, and many blocks with a tail.
@pytest.mark.parametrize("numel", [pytest.param(1024, marks=pytest.mark.slow), 1024 + 1,
                                   pytest.param(3 * 1024 + 7, marks=pytest.mark.slow), 262_144 + 5])
@pytest.mark.parametrize("checksum_on", [False, True], ids=["nocrc", "crc"])
@pytest.mark.parametrize("in_place", [False, True], ids=["atomic", "in-place"])
def test_direct_transfers_of_aligned_tensors(tmp_path, backend, numel, checksum_on, in_place):
    """Note [direct transfers]: aligned tensors go to and from disk with no
    staging buffer (the pool is never touched) and round-trip exactly, at
    sizes that are not a multiple of the block, through a staged store too."""
    store = _store(tmp_path, checksum=checksum_on, atomic=not in_place,
                   aio=aio.AioConfig(block_size=1 << 16, backend=backend))
    src = _aligned(torch.randn(numel, generator=torch.Generator().manual_seed(numel)))
    expected = src.clone()
    store.swap_out("t", src, borrow=True).wait()
    assert store.stats.buffer_peak_bytes <= 2 * HEADER_BYTES  # the header and the tail padding only
    out = _aligned(torch.full((numel,), float("nan")))
    torch.testing.assert_close(store.swap_in("t", out=out).wait(), expected, rtol=0, atol=0)
    staged = store.swap_in("t").wait()  # an unaligned destination reads through the pool
    torch.testing.assert_close(staged, expected, rtol=0, atol=0)
    # A file written through staging is read directly, and the other way round.
    store.swap_out("s", expected.clone()).wait()
    torch.testing.assert_close(store.swap_in("s", out=out).wait(), expected, rtol=0, atol=0)
    store.close()


def test_direct_read_detects_corruption_and_truncation(tmp_path):
    store = _store(tmp_path, checksum=True)
    src = _aligned(torch.arange(5000, dtype=torch.float32))
    store.swap_out("t", src, borrow=True).wait()
    path = store.path_of("t")
    with open(path, "r+b") as f:  # flip one data byte past the first block
        f.seek(HEADER_BYTES + 4097)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 4097)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(aio.CorruptFileError, match="mismatch"):
        store.swap_in("t", out=_aligned(torch.zeros(5000))).wait()
    os.truncate(path, HEADER_BYTES + 100)
    with pytest.raises(aio.TruncatedFileError):
        store.swap_in("t", out=_aligned(torch.zeros(5000))).wait()
    store.close()


def test_borrowed_tensor_is_kept_alive_until_written(tmp_path):
    store = _store(tmp_path)
    h = store.swap_out("t", _aligned(torch.arange(4096, dtype=torch.float32)), borrow=True)
    import gc
    gc.collect()  # the store holds the only reference while the write is in flight
    h.wait()
    torch.testing.assert_close(store.swap_in("t").wait(), torch.arange(4096, dtype=torch.float32))
    store.close()
