"""The swap stores an engine opens at initialize, and the parameter staging pool:
what each store is for (Note [one store per thread]), their settings, the free
space they need, and opening them inside the run's own directories."""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import tempfile

import torch

from offload.accounting import MemoryAccount
from offload.aio.memory import ALIGN, pins, round_up
from offload.aio.run_dir import RunDirectories
from offload.aio.swap_config import SwapConfig
from offload.aio.swap_store import SwapStore, SwapStoreError
from offload.config import Config
from offload.transfers import nvme_home
from offload.transfers.collectives import ProcessGroupInfo
from offload.partition.prefetch import prefetch_limits
from offload.tiers import Tier


def staging_plan(planned: list, config: Config, dtype: torch.dtype, separate_memory: bool,
                  world_size: int) -> tuple[int, int] | None:
    """(buffer bytes, depth) of the parameter staging pool (Note [staging pool] in
    offload/aio/buffer_pool.py), or None when parameter reads need no staging.
    Buffers hold the largest NVMe partition; depth: nvme_home.staging_depth, cut
    to what memory.pinned_budget holds when they are pinned. A pinned budget that
    cannot hold MIN_STAGING_DEPTH of them is refused here, before anything moves."""

    nvme = [pl for pl in planned if pl.home is Tier.NVME]
    if not nvme or not nvme_home.stages_reads(world_size, separate_memory):
        return None
    zero = config.zero_optimization
    buffer_bytes = round_up(max(pl.part_numel * (pl.itemsize or dtype.itemsize) for pl in nvme))
    largest_offloaded = max(pl.padded_numel for pl in planned if pl.home is not Tier.DEVICE)
    bucket, _, _ = prefetch_limits(zero, largest_offloaded)
    depth = nvme_home.staging_depth([pl.padded_numel for pl in nvme], bucket)
    budget = config.memory.pinned_budget
    if budget is not None and pins(cuda=separate_memory, pin_memory=zero.offload_param.pin_memory):
        least = nvme_home.MIN_STAGING_DEPTH * buffer_bytes
        if budget < least:
            raise MemoryError(
                f"memory.pinned_budget is {budget} bytes but the parameter staging pool needs at least "
                f"{least} ({nvme_home.MIN_STAGING_DEPTH} buffers of the largest NVMe partition, "
                f"{buffer_bytes} bytes: one read ahead and the one a step waits on); raise "
                f"memory.pinned_budget to at least {least}, or set "
                "zero_optimization.offload_param.pin_memory to false (unpinned staging)")
        depth = min(depth, budget // buffer_bytes)
    return buffer_bytes, depth


# Note [one store per thread]
# A SwapStore is driven by one thread (it finishes transfers in submission
# order). The compute thread reads parameters while the host worker
# reads and writes state and writes new parameter values (Note [optimizer
# overlap]), so each gets its own stores, over the same files: the
# optimizer writes a parameter's file only after its gradient is final,
# and the compute thread reads it again only after step() has waited.
# A model built under offload.init brings its parameter store along.
def store_configs(planned: list, config: Config, rank: int, have_param_store: bool) -> dict:
    """The swap stores' settings, by role (Note [one store per thread]): "param"
    for the compute thread's reads, "state" for the optimizer's state, "writer"
    for new parameter values (where state and parameters have different paths)."""
    zero = config.zero_optimization
    dtype = config.precision.dtype
    nvme_sizes = [pl.part_numel * (pl.itemsize or dtype.itemsize) for pl in planned if pl.home is Tier.NVME]
    nvme_state = [pl.part_numel for pl in planned if pl.state is Tier.NVME]
    param_path = os.fspath(zero.offload_param.nvme_path) if nvme_sizes else None
    state_path = os.fspath(zero.offload_optimizer.nvme_path) if nvme_state else None
    configs = {}
    if nvme_sizes and not have_param_store:
        op = zero.offload_param
        staging = op.buffer_count * op.buffer_size * dtype.itemsize if op.buffer_count and op.buffer_size else None
        configs["param"] = _swap_config(param_path, nvme_sizes, staging, config, rank)
    if state_path is not None:
        oo = zero.offload_optimizer
        staging = oo.buffer_count * max(nvme_state) * 4 if oo.buffer_count else None
        configs["state"] = _swap_config(state_path, [3 * n * 4 for n in nvme_state], staging, config, rank)
    if nvme_sizes and state_path != param_path:
        # Writes the same files as the parameter store, which holds their disk
        # space: no capacity of its own, but the same staging budget. Sized from
        # no tensors it had 8 KiB, and a new value not aligned for a direct
        # write went through in 4 KiB pieces (GPT 67M, optimizer state on the
        # host: a 7 s step).
        writer = _swap_config(param_path, nvme_sizes, None, config, rank)
        configs["writer"] = dataclasses.replace(writer, capacity_bytes=0)
    return configs


def _swap_config(nvme_path, sizes, staging_bytes, config: Config, rank: int):
    """A store's settings. staging_bytes: the host staging budget from DeepSpeed's
    keys (offload_param.buffer_count x buffer_size elements, offload_optimizer.
    buffer_count x the largest state partition): the same budgets, except that a
    tensor larger than the budget streams through it in pieces instead of
    failing ("More elements than buffer size"). None: sized from the model, two
    of the largest files up to 32 MiB: the engine's own transfers are aligned
    and skip staging (Note [direct transfers]); staging carries headers, small
    tensors and the first write of each parameter."""

    # atomic=False: swap files are scratch, written and read back by this
    # process and removed at close; overwriting in place skips a rename and a
    # block reallocation per write (9 ms each on ext4, measured); a write that
    # fails keeps its value in memory instead (Note [failed in-place writes]).
    # checksum: Note [swap data checksums] in offload/aio/swap_store.py.
    swap_config = SwapConfig.for_tensors(nvme_path, sizes, in_flight=2, rank=rank,
                                         aio=config.aio, atomic=False,
                                         checksum=config.aio.verify_swap_checksums)
    if staging_bytes is None:
        staging_bytes = min(swap_config.buffer_bytes, 8 << 20)
    swap_config = dataclasses.replace(swap_config, buffer_bytes=max(staging_bytes, 2 * ALIGN))
    return swap_config


def check_free_space(swap_configs: dict, pg=None) -> None:
    """Note [free space for the stores]: each store checks its own capacity when
    it opens, but the stores of one engine open one after the other on what is
    often one file system, so each alone fitted and together they did not (the
    disk filled while the parameters moved home). Here every store's capacity
    is summed per file system (st_dev of nvme_path, or of its nearest existing
    parent) and checked against its free space before anything is written. With several
    ranks (pg) the sum is over every rank of this host whose files go to the same file
    system (Note [the node's share] in offload/node.py): ranks sharing a disk each
    fitted alone and filled it together."""

    what = {"param": "parameters", "state": "optimizer state"}
    by_device: dict[int, list] = {}
    refused = None  # raised after the other ranks heard of it: none waits in a collective alone
    try:
        for role, c in swap_configs.items():
            if c.capacity_bytes:
                at = _existing_parent(c.nvme_path)
                _check_can_make(c.nvme_path, at)
                by_device.setdefault(os.stat(at).st_dev, []).append((what.get(role, role), c, at))
    except SwapStoreError as exc:
        refused = exc
    others, refusals = _other_ranks_needs(by_device, pg, refused)
    if refused is not None:
        raise refused
    if refusals:
        rank, why = refusals[0]
        raise SwapStoreError(errno.EIO, f"rank {rank} refused its nvme_path: {why}")
    for dev, entries in by_device.items():
        need = sum(c.capacity_bytes for _, c, _ in entries)
        theirs = others.get(dev, {})
        need += sum(theirs.values())
        free = shutil.disk_usage(entries[0][2]).free
        if need > free:
            parts = " + ".join(f"{name} {c.capacity_bytes} bytes under {c.nvme_path}" for name, c, _ in entries)
            if theirs:
                parts += "".join(f" + rank {r}'s {n} bytes" for r, n in sorted(theirs.items()))
            raise SwapStoreError(
                errno.ENOSPC,
                f"not enough free space for the swap files: {need} bytes needed ({parts}) on the file "
                f"system of {entries[0][2]}, {free} bytes free ({need - free} short); free some space or "
                "point zero_optimization.offload_param/offload_optimizer.nvme_path at a larger disk")


def _other_ranks_needs(by_device: dict, pg, refused) -> tuple[dict[int, dict[int, int]], list]:
    """Per file system (st_dev) of this rank's stores, the bytes each other rank of this host
    will write there, and the other ranks' refusals: asked of every rank (a collective:
    each rank calls it once, whether its own paths passed or not)."""
    if pg is None or pg.job_size == 1:
        return {}, []
    import socket

    import torch.distributed as dist

    mine = (socket.gethostname(), {dev: sum(c.capacity_bytes for _, c, _ in entries)
                                   for dev, entries in by_device.items()}, None if refused is None else str(refused))
    everyone: list = [None] * pg.job_size
    dist.all_gather_object(everyone, mine, group=pg.job_group)
    others: dict[int, dict[int, int]] = {}
    me = pg.job_rank
    refusals = [(rank, why) for rank, (_, _, why) in enumerate(everyone) if why is not None and rank != me]
    for rank, (host, needs, _) in enumerate(everyone):
        if rank == me or host != mine[0]:
            continue
        for dev, nbytes in needs.items():
            if dev in by_device and nbytes:
                others.setdefault(dev, {})[rank] = nbytes
    return others, refusals


def _check_can_make(nvme_path, at: str) -> None:
    """Refuses an nvme_path whose folders cannot be made: its nearest existing part is a
    file, or a folder this process may not write (a read-only mount, /proc), before the
    free space of a place no file can go is reported."""

    if not os.path.isdir(at):
        raise SwapStoreError(errno.ENOTDIR, f"nvme_path {nvme_path}: {at} is a file, not a folder; point "
                             "zero_optimization.offload_param/offload_optimizer.nvme_path at a folder")
    try:  # asked of the file system itself: access() says yes to root on /proc and read-only mounts
        os.rmdir(tempfile.mkdtemp(prefix=".offload-probe-", dir=at))
    except OSError as exc:
        raise SwapStoreError(exc.errno or errno.EACCES,
                             f"nvme_path {nvme_path}: no folder can be made in {at} ({exc.strerror}); point "
                             "zero_optimization.offload_param/offload_optimizer.nvme_path at a folder this "
                             "process may write") from exc


def _existing_parent(path) -> str:
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def open_store(swap_config, account: MemoryAccount, run_dirs: RunDirectories):
    """The store's files go to this process's own directory under nvme_path,
    `nvme_path/offload-<host>-<pid>-<random>/rank{r}/` (Note [run directories]
    in offload/aio/run_dir.py); stores on one nvme_path share it."""

    run_dir = run_dirs.open(swap_config.nvme_path)
    swap_config = dataclasses.replace(swap_config, nvme_path=str(run_dir.path))
    return SwapStore(swap_config, ledger=account.ledger(Tier.HOST))


def open_swap_store(nvme_path, sizes, staging_bytes, config: Config, pg: ProcessGroupInfo,
                    account: MemoryAccount, run_dirs: RunDirectories):
    """A store opened at once (offload.init, before the model's size is known)."""
    return open_store(_swap_config(nvme_path, sizes, staging_bytes, config, pg.rank), account, run_dirs)
