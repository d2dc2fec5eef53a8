"""What the update schedulers (offload/step/updates.py) need of the optimizer whose
updates they run: a small interface, so they depend on it rather than on ShardedAdam,
and their unit tests (tests/step/test_updates.py) can stand in for it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from offload.accounting import MemoryAccount
from offload.optim.states import ShardStates
from offload.partition.shard import Shard
from offload.timeline import Timeline

if TYPE_CHECKING:
    import torch

    from offload.optim.state_stream import StateStream


class UpdateTarget(Protocol):
    """The optimizer side of an update overlapped with backward or run under the next
    forward (ShardedAdam is one)."""

    param_groups: list[dict]
    shards: list[Shard]
    states: ShardStates  # where each shard's state lives (state_tier, state_tiers, shares_master)
    account: MemoryAccount
    timeline: Timeline

    def group_index(self, shard: Shard) -> int: ...

    def stepping(self) -> list[Shard]: ...

    def open_stream(self, order: list[Shard], skip_master: frozenset = frozenset()) -> "StateStream | None": ...

    def close_stream(self, stream: "StateStream | None") -> None: ...

    def update_shard(self, shard: Shard, group: dict, stream: "StateStream | None",
                     master_value: "torch.Tensor | None" = None) -> None: ...

    def uploads_after_update(self, shard: Shard) -> bool: ...

    def flush_publishes(self) -> None: ...

    def beside_compute(self, sharing: bool) -> None:
        """Updates from now on run beside the compute thread (fewer kernel threads) or not."""
