"""What an engine gives back when it closes, or when initialize fails part way:
the parameters' values, its swap files, the process group and the device layer
(a mixin of Engine, offload/engine/engine.py; Engine.close orders the steps)."""
from __future__ import annotations

import logging

import psutil

from offload.partition.compiled import uncompile_blocks
from offload.partition.managed import unmanage
from offload.tiers import Tier

log = logging.getLogger("offload")


class Teardown:
    def _give_values_back(self) -> bool:
        """At close: each parameter becomes a plain tensor holding its value (the
        fp32 master, in its original dtype; a frozen one's compute-dtype home, in its
        original dtype: Note [frozen parameters]) when the model fits in half the memory
        available; otherwise its values go with the swap files, and reading them
        raises (Note [reading a parameter outside the engine]). A frozen host home
        already in the parameter's own dtype (one rank) is handed over as it is: it
        needs no memory more (a LoRA's bf16 base given back whole)."""
        need = sum(s.numel * max(4, s.original_dtype.itemsize) for s in self.shards
                   if s.home is not Tier.DEVICE and not self._handed_over_as_is(s))
        # Every rank decides alike: reading the values back is a collective.
        if self.pg.any_flag(need > 0.5 * psutil.virtual_memory().available, self.device):
            log.warning("engine.close(): the parameters (%.1f GiB) do not fit in memory and are not given "
                        "back to the model; save them before closing", need / 2**30)
            self._forget_homes()
            return False
        try:
            values = {shard.name: (shard.host_part[:shard.numel].view(shard.shape)
                                   if self._handed_over_as_is(shard) else self.full_value(shard, master=True))
                      for shard in self.shards}
        except Exception:  # noqa: BLE001 - closing after a failure: reads then raise instead
            log.exception("engine.close(): could not read the parameters back")
            return False
        unmanage(self.shards)
        for shard in self.shards:
            shard.param.data = values[shard.name].to(shard.original_dtype)
        return True

    def _handed_over_as_is(self, shard) -> bool:
        return (not shard.trainable and shard.home is Tier.HOST and shard.host_part is not None
                and self.pg.world_size == 1 and shard.dtype == shard.original_dtype)

    def _forget_homes(self) -> None:
        """The values were not given back: the host homes' memory goes now, not when the
        last reference to the model does (reads raise either way)."""
        for shard in self.shards:
            if shard.home is Tier.HOST:
                shard.host_part = shard._host_alias = None

    def _remove_swap_files(self) -> None:
        for store in self._stores:
            store.close()
        # The engine closes its stores itself, not through ParamStore.close: the
        # parameter staging pool's buffers and their host (and pinned) charge go here.
        param_store = self.shard_context and self.shard_context.param_store
        if param_store is not None and param_store.staging is not None:
            param_store.staging.close()
        self._run_dirs.remove()  # the files and this run's directory, whoever made nvme_path

    def _abort(self) -> None:
        unmanage(self.shards)
        # Note [an interrupted initialize] (build.py): the shards not placed kept or got back their tensor.
        for shard in self._placed:
            if self.pg.world_size > 1:
                break  # a partition is not the whole value
            try:  # the master: the original value in fp32, not the compute-dtype copy
                value = self.optimizer.master_partition(shard)
            except Exception:  # noqa: BLE001 - best effort: the original error matters
                log.warning("initialize failed and the fp32 value of %s could not be read back; it is "
                            "restored from its %s copy", shard.name, shard.dtype, exc_info=True)
                try:
                    value = shard.home_partition()
                except Exception:  # noqa: BLE001
                    continue
            shard.param.data = value[:shard.numel].view(shard.shape).to(shard.original_dtype)
        if self.manager is not None:
            self.manager.remove_hooks()
        if self.optimizer is not None:
            self.optimizer.close()
        if self._host_worker is not None:
            self._host_worker.shutdown()
        if self.activation_checkpointing is not None:
            self.activation_checkpointing.remove()
            uncompile_blocks(self.compiled_blocks)  # Note [compiled blocks]
        self._remove_swap_files()
        self.pg.release()  # Note [releasing the process group] in partition/collectives.py
        self._close_device()

    def _close_device(self) -> None:
        """The copy streams' pinned pool, then the layer (the sim's stream threads)."""
        streams = self.shard_context and self.shard_context.streams
        if streams is not None:
            streams.close()
        self.device_layer.close()
