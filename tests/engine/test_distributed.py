"""World size 2 on CPU (gloo): each rank trains on its own micro-batches; the
result equals one plain PyTorch model trained on both ranks' batches with the
loss averaged, as data parallelism promises."""
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import offload.device

from tests.engine.ranks import run_ranks
from tests.support.harness import (batches, build, make_config, run_engine, run_reference,
                                  run_reference_mixed)

pytestmark = pytest.mark.slow  # its one test spawns two ranks: ~15 s

CASES = [
    # model, param, optim, precision, gas
    ("tiny_gpt", "cpu", "cpu", "fp32", 1),
    ("tiny_gpt", "nvme", "nvme", "fp32", 4),
    ("shared_param", "none", "none", "fp32", 2),
    ("with_unused", "nvme", "cpu", "fp32", 1),
    ("tiny_gpt", "cpu", "nvme", "bf16", 1),
]


def _worker(rank, world, port, nvme_root, device, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OFFLOAD_DEVICE=device,
                      OFFLOAD_SIM_SEED=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for i, (name, param, optim, precision, gas) in enumerate(CASES):
            try:
                model = build(name)
                data = batches(12, world=world, seed=i)
                if precision == "fp32":
                    ref_model, ref_losses = run_reference(model, data, gas=gas, clip=0.0, lr=1e-2,
                                                          weight_decay=0.01, world=world)
                else:
                    ref_model, ref_losses = run_reference_mixed(
                        model, data, dtype=torch.bfloat16, gas=gas, lr=1e-2, weight_decay=0.01,
                        world=world)
                cfg = make_config(param, optim, os.path.join(nvme_root, f"case{i}"), gas=gas,
                                  precision=precision)
                weights, losses, engine = run_engine(model, data, cfg, rank=rank)
                assert offload.device.selected_name() == device
                torch.testing.assert_close(losses, ref_losses[:, rank])
                for pname, p in ref_model.named_parameters():
                    torch.testing.assert_close(weights[pname], p.detach(),
                                               msg=lambda m: f"{pname}: {m}")
                results.put((rank, i, "ok"))
            except Exception:  # noqa: BLE001 - reported to the parent test
                results.put((rank, i, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# sim: the simulated asynchronous device (Note [copy streams]): copy-ins, all-gathers and
# reduce-scatters of device buffers, gradients to the host on a stream, each rank its own jitter.
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_world_size_two_matches_data_parallel_pytorch(tmp_path, device):
    outcome, procs = run_ranks(_worker, (str(tmp_path), device))
    failures = {k: v for k, v in outcome.items() if v != "ok"}
    assert not failures, "\n".join(f"rank {r} case {CASES[c]}:\n{msg}" for (r, c), msg in failures.items())
    assert len(outcome) == 2 * len(CASES), f"workers reported {len(outcome)} of {2 * len(CASES)} results"
    # Every rank also exits cleanly (a SIGABRT at interpreter exit after good results: issue 16).
    assert [p.exitcode for p in procs] == [0, 0], f"worker exit codes {[p.exitcode for p in procs]}"
    for r in range(2):  # each rank wrote under its own directory, removed when its engine closed
        assert not any((tmp_path / "case1").glob(f"offload-*/rank{r}"))
