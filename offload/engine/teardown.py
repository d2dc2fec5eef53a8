"""What an engine gives back when it closes, or when initialize fails part way:
the parameters' values, its swap files, the process group and the device layer.
Functions of the engine's parts, not methods: Engine.close orders the steps, and
an initialize that fails part way calls abort (offload/engine/engine.py)."""
from __future__ import annotations

import logging

import psutil

from offload.compile.blocks import uncompile_blocks
from offload.partition.managed import unmanage
from offload.partition.quantized import unpage
from offload.tiers import Tier

log = logging.getLogger("offload")


def give_values_back(engine) -> bool:
    """At close: each parameter becomes a plain tensor holding its value (the
    fp32 master, in its original dtype; a frozen one's compute-dtype home, in its
    original dtype: Note [frozen parameters]) when the model fits in half the memory
    available; otherwise its values go with the swap files, and reading them
    raises (Note [reading a parameter outside the engine]). A frozen host home
    already in the parameter's own dtype (one rank) is handed over as it is: it
    needs no memory more (a LoRA's bf16 base given back whole)."""
    need = sum(s.numel * max(4, s.original_dtype.itemsize) for s in engine.shards
               if s.home is not Tier.DEVICE and not _handed_over_as_is(engine, s))
    # Every rank decides alike: reading the values back is a collective.
    if engine.pg.any_flag(need > 0.5 * psutil.virtual_memory().available, engine.device):
        log.warning("engine.close(): the parameters (%.1f GiB) do not fit in memory and are not given "
                    "back to the model; save them before closing", need / 2**30)
        _forget_homes(engine)
        return False
    try:
        values = {shard.name: (shard.host_part[:shard.numel].view(shard.shape)
                               if _handed_over_as_is(engine, shard) else engine.full_value(shard, master=True))
                  for shard in engine.shards}
    except Exception:  # noqa: BLE001 - closing after a failure: reads then raise instead
        log.exception("engine.close(): could not read the parameters back")
        return False
    unmanage(engine.shards)
    for shard in engine.shards:
        shard.param.data = values[shard.name].to(shard.original_dtype)
    unpage(engine.paged_modules)  # after the values: an 8-bit layer points at its weight's
    return True


def _handed_over_as_is(engine, shard) -> bool:
    return (not shard.trainable and shard.home is Tier.HOST and shard.host_part is not None
            and engine.pg.world_size == 1 and shard.dtype == shard.original_dtype)


def _forget_homes(engine) -> None:
    """The values were not given back: the host homes' memory goes now, not when the
    last reference to the model does (reads raise either way)."""
    for shard in engine.shards:
        if shard.home is Tier.HOST:
            shard.host_part = shard._host_alias = None


def remove_swap_files(engine) -> None:
    for store in engine._stores:
        store.close()
    # The engine closes its stores itself, not through ParamStore.close: the
    # parameter staging pool's buffers and their host (and pinned) charge go here.
    param_store = engine.shard_context and engine.shard_context.param_store
    if param_store is not None and param_store.staging is not None:
        param_store.staging.close()
    engine._run_dirs.remove()  # the files and this run's directory, whoever made nvme_path


def abort(engine) -> None:
    unmanage(engine.shards)
    # Note [an interrupted initialize] (build.py): the shards not placed kept or got back their tensor.
    for shard in engine._placed:
        if engine.pg.world_size > 1:
            break  # a partition is not the whole value
        try:  # the master: the original value in fp32, not the compute-dtype copy
            value = engine.optimizer.master_partition(shard)
        except Exception:  # noqa: BLE001 - best effort: the original error matters
            log.warning("initialize failed and the fp32 value of %s could not be read back; it is "
                        "restored from its %s copy", shard.name, shard.dtype, exc_info=True)
            try:
                value = shard.home_partition()
            except Exception:  # noqa: BLE001
                continue
        shard.param.data = value[:shard.numel].view(shard.shape).to(shard.original_dtype)
    unpage(engine.paged_modules)  # after the values, as in give_values_back
    if engine.manager is not None:
        engine.manager.remove_hooks()
    if engine.optimizer is not None:
        engine.optimizer.close()
    if engine._host_worker is not None:
        engine._host_worker.shutdown()
    if engine.activation_checkpointing is not None:
        engine.activation_checkpointing.remove()
        uncompile_blocks(engine.compiled_blocks)  # Note [compiled blocks]
    remove_swap_files(engine)
    engine.pg.release()  # Note [releasing the process group] in transfers/collectives.py
    close_device(engine)


def close_device(engine) -> None:
    """The copy streams' pinned pool, then the layer (the sim's stream threads)."""
    streams = engine.shard_context and engine.shard_context.streams
    if streams is not None:
        streams.close()
    engine.device_layer.close()
