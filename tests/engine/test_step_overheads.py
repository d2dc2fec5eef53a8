"""Per-step overheads that a model of many small parameters feels (the main
job, examples/finetune.py): the engine's bookkeeping stays out of the
forward's TorchFunctionMode, and optimizer-state writes of small shards do
not wait for each other."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import offload
from offload.optim.state_stream import StateStream
from offload.partition.gather_on_use import GatherOnUse
from offload.accounting import MemoryAccount, Tier
from offload.timeline import Timeline
from tests.support.harness import batches, build, lm_loss, make_config


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_forward_dispatches_only_the_models_own_calls_through_the_gather_mode(tmp_path, monkeypatch):
    """Note [bookkeeping outside the mode]: an engine forward with everything
    on NVMe (reads, prefetch, releases, saved-tensor records, activation
    accounting) passes exactly the calls plain PyTorch's forward makes through
    the manager's TorchFunctionMode, not thousands of its own."""
    model = build("tiny_gpt")
    (x, y), = batches(1)[0]
    reference = copy.deepcopy(model)
    with _Counting() as plain:
        reference(x)

    calls = {"n": 0}
    original = GatherOnUse.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls["n"] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(GatherOnUse, "__torch_function__", counting)
    with offload.initialize(model, make_config("nvme", "nvme", tmp_path)) as engine:
        for step in range(3):  # from the second pass on, reads go ahead in the learned order
            calls["n"] = 0
            logits = engine(x)
            forward_calls = calls["n"]
            engine.backward(lm_loss(logits, y))
            engine.step()
            assert forward_calls == plain.calls > 0, step
        assert engine.manager.prefetch.stats["prefetched"] > 0


class _FakeStore:
    """Transfers that finish only when waited on, so every wait is counted."""

    def __init__(self):
        self.waits = []

    def _handle(self, what):
        store = self

        class Handle:
            finished = False

            def done(self):
                return self.finished

            def wait(self):
                if not self.finished:
                    store.waits.append(what)
                    self.finished = True

        return Handle()

    def swap_in(self, key, out):
        return self._handle(("read", key))

    def swap_out(self, key, buf, borrow=False):
        return self._handle(("write", key))

    def writes_waited(self):
        return [key for op, key in self.waits if op == "write"]


def test_state_writes_in_flight_are_bounded_by_bytes_not_count():
    """Ten small shards' writes stay in flight together (each waiting for the
    one before cost a 3.3M-parameter GPT's update in step() 13 ms); a large one
    makes the small ones finish first, so the bytes written back never pass
    the largest shard's state, as the memory budget counts."""
    big = SimpleNamespace(index=0, part_numel=1000, name="big")
    small = [SimpleNamespace(index=i, part_numel=10, name=f"small{i}") for i in range(1, 11)]
    order = small + [big]
    store, account = _FakeStore(), MemoryAccount()
    stream = StateStream(store, lambda s: f"optim.{s.index}", order, account=account,
                         timeline=Timeline(enabled=False), ahead=len(order))
    stream.start()
    cap = 3 * big.part_numel * 4

    def in_flight():
        return [(name, n) for (handle, n, _, name) in stream._writes if not handle.done()]

    for shard in small:
        stream.put(shard, stream.take(shard))
    assert store.writes_waited() == []
    assert len(in_flight()) == len(small)

    stream.put(big, stream.take(big))
    flying = in_flight()
    assert flying == [("big", 3 * big.part_numel * 4)], flying
    assert sum(n for _, n in flying) <= cap
    stream.close()
    assert account.usage(Tier.HOST).now == 0



def test_a_failed_state_write_still_waits_for_and_credits_every_other_write():
    """A write that fails (a full disk) must not leave the writes after it in
    flight: their buffers go back to the cache for reuse, and the host account
    would keep their bytes forever. close() waits for all, then raises the first error."""
    small = [SimpleNamespace(index=i, part_numel=7, name=f"s{i}") for i in range(1, 4)]
    big = SimpleNamespace(index=0, part_numel=1000, name="big")  # sets the bytes cap: small writes stay in flight

    class _FailingWrite(_FakeStore):
        def swap_out(self, key, buf, borrow=False):
            handle = super().swap_out(key, buf, borrow)
            if key == "optim.1":
                inner_wait = handle.wait

                def wait():
                    inner_wait()
                    raise OSError(28, "No space left on device", key)

                handle.wait = wait
            return handle

    store, account = _FailingWrite(), MemoryAccount()
    stream = StateStream(store, lambda s: f"optim.{s.index}", small + [big], account=account,
                         timeline=Timeline(enabled=False), ahead=len(small) + 1)
    stream.start()
    for shard in small:
        stream.put(shard, stream.take(shard))
    assert store.writes_waited() == []  # all three in flight when close() comes
    with pytest.raises(OSError, match="optim.1"):
        stream.close()
    assert store.writes_waited() == ["optim.1", "optim.2", "optim.3"]
    assert account.usage(Tier.HOST).now == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_new_parameter_values_go_to_nvme_in_a_few_transfers_with_host_optimizer_state(tmp_path, monkeypatch,
                                                                                      precision):
    """Parameters on NVMe, optimizer state in host memory: each new value is
    one write of the whole partition (a direct one from the aligned fp32
    master, or one staged piece), not thousands of 4 KiB pieces (the writer
    store once had an 8 KiB staging budget: a 7 s step for GPT 67M)."""
    from offload.aio import swap_store as swap_store_module

    transfers: dict[str, int] = {}
    original = swap_store_module.SwapStore._start

    def counting(self, handle, op, *args, **kwargs):
        if op == "pwrite" and handle.key.startswith("param."):
            transfers[handle.key] = transfers.get(handle.key, 0) + 1
        return original(self, handle, op, *args, **kwargs)

    model = build("tiny_gpt")
    (x, y), = batches(1)[0]
    with offload.initialize(model, make_config("nvme", "cpu", tmp_path, precision=precision)) as engine:
        transfers.clear()  # the first writes at initialize are not what this is about
        engine.backward(lm_loss(engine(x), y))
        monkeypatch.setattr(swap_store_module.SwapStore, "_start", counting)
        engine.step()
        nvme = [s for s in engine.shards if s.home.name == "NVME"]
    assert nvme and sorted(transfers) == sorted(f"param.{s.index}" for s in nvme)
    # header + data (+ tail padding) when direct; data + header when staged
    assert max(transfers.values()) <= 3, transfers
