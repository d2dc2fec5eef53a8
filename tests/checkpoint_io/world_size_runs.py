"""Runs for tests/checkpoint_io/test_resume_world_size.py, importable by spawned gloo workers.

X resumes a checkpoint saved at another world size (load_checkpoint re-partitions);
Y starts at the new size from the same state handed over independently: the model
built with the saved full fp32 masters, the optimizer given the saved full Adam
state through torch's format (optimizer.load_state_dict, cut to this rank's
partition here in the test), the schedule and counters set directly. Both then
train the same steps and must agree bit for bit."""
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

import offload
from tests.checkpoint_io import checkpoint_runs as runs
from tests.support.harness import batches, build, make_config, train_engine

STEPS = 2


def config(root: Path, tiers, name: str, rank: int):
    return make_config(*tiers, root / f"swap-{name}-{rank}", scheduler=runs.WARMUP)


def record(engine) -> dict:
    """The full masters (a collective) and this rank's optimizer state in torch's format."""
    return {"masters": engine.full_state_dict(master=True), "optim": engine.optimizer.state_dict(),
            "sched": engine.lr_scheduler.state_dict(), "counters": (engine.global_steps, engine.micro_steps)}


def train(engine, world: int, rank: int, seed: int):
    train_engine(engine, batches(STEPS, world=world, seed=seed), rank=rank)


def first_run(root: Path, tiers, world: int, rank: int) -> None:
    """STEPS steps at `world` ranks, a checkpoint, and the state as recorded (every rank's)."""
    with offload.initialize(build("tiny_gpt"), config(root, tiers, "first", rank)) as e:
        train(e, world, rank, seed=1)
        e.save_checkpoint(root / "ck")
        torch.save(record(e), root / f"saved.rank{rank}.pt")


def full_optimizer_state(root: Path, saved_world: int, numels: dict[int, int]) -> dict:
    """The saved ranks' partitions of each state tensor, concatenated, padding stripped."""
    parts = [torch.load(root / f"saved.rank{r}.pt", weights_only=False)["optim"] for r in range(saved_world)]
    full = {}
    for i, n in numels.items():
        full[i] = {k: torch.cat([p["state"][i][k] for p in parts])[:n]
                   for k in ("exp_avg", "exp_avg_sq", "offload_fp32_master")}
        full[i]["step"] = parts[0]["state"][i]["step"]
    return full, parts[0]["param_groups"]


def my_partition(full: torch.Tensor, part: int, rank: int) -> torch.Tensor:
    padded = torch.zeros(part * (rank + 1), dtype=full.dtype)
    n = min(full.numel(), padded.numel())
    padded[:n] = full[:n]
    return padded[rank * part:(rank + 1) * part]


def resume(root: Path, tiers, saved_world: int, world: int, rank: int) -> None:
    """X and Y at `world` ranks (see the module's docstring); both results saved for the test."""
    saved0 = torch.load(root / "saved.rank0.pt", weights_only=False)
    with offload.initialize(build("tiny_gpt", seed=5), config(root, tiers, "x", rank)) as x:
        x.load_checkpoint(root / "ck")
        indexed = x.optimizer.indexed()
        numels = {i: s.numel for i, s in indexed}
        full, groups = full_optimizer_state(root, saved_world, numels)
        at_load = x.optimizer.state_dict()
        train(x, world, rank, seed=2)
        x_out = record(x)
        part_index = x.pg.rank  # this rank's place in its shard group (Note [hybrid sharding])
    mine = {i: {k: (v if k == "step" else my_partition(v, s.part_numel, part_index)) for k, v in full[i].items()}
            for i, s in indexed}
    model = build("tiny_gpt", seed=6)
    model.load_state_dict(saved0["masters"])
    with offload.initialize(model, config(root, tiers, "y", rank)) as y:
        y.optimizer.load_state_dict({"state": mine, "param_groups": groups})
        y.lr_scheduler.load_state_dict(saved0["sched"])
        y.global_steps, y.micro_steps = saved0["counters"]
        train(y, world, rank, seed=2)
        y_out = record(y)
    torch.save({"at_load": at_load, "expected_at_load": mine, "x": x_out, "y": y_out},
               root / f"resumed{world}.rank{rank}.pt")


# ---- launching ---------------------------------------------------------------------------
def _worker(fn_name, args, rank, world, port, nodes):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if nodes is not None:  # Note [node names] in offload/node.py
        os.environ["OFFLOAD_NODE"] = nodes[rank]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        globals()[fn_name](*args, world=world, rank=rank)
    finally:
        dist.destroy_process_group()


def run_ranks(fn_name, args, world: int, timeout: float = 240, nodes: list[str] | None = None) -> None:
    """fn(*args, world=, rank=) on `world` spawned gloo processes, rank r on node nodes[r]
    (default: this host's); every exit code must be 0."""
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(fn_name, args, r, world, port, nodes)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"{fn_name} at world size {world}: exit codes {codes}"
