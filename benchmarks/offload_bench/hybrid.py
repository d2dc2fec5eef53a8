"""One rank of benchmarks/hybrid_sharding.py, run under torchrun (two launches, two nodes).

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0,1} ... -m offload_bench.hybrid SPEC_JSON

Each rank:
  1. measures the machine's rates where it stands, every rank at once (Note
     [step-time model] in offload/sizing/step_time.py): a rank's link within its
     node (an all_gather between the two ranks of a node), a node's link across
     (an all_gather between rank i and i + 2), its compute (forward and backward of
     the model in plain PyTorch) and its host Adam (offload's kernel on its share);
  2. trains the model with offload, flat (shard_group_size "world") and hybrid
     ("node"), each with the spec's offloads: one warm-up step, then the timed steps,
     a barrier before each so every rank's step starts together; counts each step's
     collective bytes per link class (Note [link classes]);
  3. rank 0 also trains plain PyTorch on the global batch (the four ranks'
     micro-batches), for the losses.
With SPEC["deepspeed_data"] it skips the rates and trains offload_bench/deepspeed_hybrid.py's
model on its batches, against its plain PyTorch reference: the DeepSpeed run's work.
Rank 0 writes SPEC["out"]/hybrid_rank0.json; the launcher predicts and reports.
The ranks' nodes come from torchrun's GROUP_RANK (Note [node names] in offload/node.py).
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload  # noqa: E402
from offload_bench.gpt import GPT, GPTConfig, lm_loss  # noqa: E402


def build(spec: dict) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    m = spec["model"]
    return GPT(GPTConfig(vocab_size=m["vocab"], hidden=m["hidden"], layers=m["layers"], heads=m["heads"],
                         max_seq=spec["seq"], tie_embeddings=False))


def batches(spec: dict, steps: int, world: int):
    if spec.get("deepspeed_data"):  # the DeepSpeed run's own batches (offload_bench/deepspeed_hybrid.py)
        from offload_bench.deepspeed_hybrid import global_batches

        return global_batches(steps, world, spec["micro"], spec["seq"], seed=spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    vocab, shape = spec["model"]["vocab"], (spec["micro"], spec["seq"])
    return [[(torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen))
             for _ in range(world)] for _ in range(steps)]


def config(spec: dict, layout: str, offload_to: str, rank: int) -> dict:
    zero = {"stage": 3, "shard_group_size": layout, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": offload_to}, "offload_optimizer": {"device": offload_to}}
    if offload_to == "nvme":
        for section in ("offload_param", "offload_optimizer"):
            zero[section]["nvme_path"] = os.path.join(spec["out"], f"swap-{layout}-{rank}")
    return {"train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": spec["lr"], "weight_decay": 0.0}},
            "zero_optimization": zero}


def _timed(fn, repeats: int) -> float:
    """The median of `repeats` runs of fn, every rank starting each together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rates(spec: dict, rank: int, world: int, per_node: int) -> dict:
    """Every rank at once, as in a step: link rates (bytes/s, ring model), compute, host Adam."""
    nbytes = spec["probe_bytes"]
    rates = {}
    pairs = {"within_node": [list(range(n * per_node, (n + 1) * per_node)) for n in range(world // per_node)],
             "across_nodes": [[i + n * per_node for n in range(world // per_node)] for i in range(per_node)]}
    for link, groups in pairs.items():
        made = [dist.new_group(g) for g in groups]
        mine = next(grp for grp, ranks in zip(made, groups) if rank in ranks)
        size = len(groups[0])
        part = torch.ones(nbytes // 4 // size, dtype=torch.float32)
        out = torch.empty(part.numel() * size)
        t = _timed(lambda: dist.all_gather_into_tensor(out, part, group=mine), spec["probe_repeats"])
        rates[link] = (size - 1) / size * out.numel() * 4 / t  # Note [step-time model]: the ring's bytes
    model = build(spec)
    x, y = batches(spec, 1, 1)[0][0]

    def fwd_bwd():
        lm_loss(model(x), y).backward()
    fwd_bwd()
    t = _timed(fwd_bwd, spec["probe_repeats"])
    n = sum(p.numel() for p in model.parameters())
    rates["flops"] = 6 * n * x.numel() / t
    rates["adam"] = _adam_rate(n // per_node, spec["probe_repeats"])
    return rates


def _adam_rate(numel: int, repeats: int) -> float:
    """Parameters a second offload's host Adam updates (a parameter of `numel`, fp32)."""
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    from offload.optim.cpu_adam import CPUAdam

    opt = CPUAdam([p], lr=1e-3)
    opt.step()
    return numel / _timed(opt.step, repeats)


def train(spec: dict, layout: str, offload_to: str, rank: int, world: int) -> dict:
    model, data = build(spec), batches(spec, 1 + spec["steps"], world)
    times, losses, counts = [], [], []
    with offload.initialize(copy.deepcopy(model), config(spec, layout, offload_to, rank)) as engine:
        pg = engine.pg
        for i, per_rank in enumerate(data):
            x, y = per_rank[rank]
            pg.reset_collective_counts()
            dist.barrier()
            t0 = time.perf_counter()
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            counts.append({link: pg.collective_counts(link) for link in ("within_node", "across_nodes")})
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the global batch's loss: the mean over ranks
            losses.append(float(mean) / world)
        layout_seen = {"group": pg.world_size, "replicas": pg.replicas, "links": pg.links}
    return {"step_s": times[1:], "median_step_s": statistics.median(times[1:]), "losses": losses,
            "bytes_per_step": counts[-1], "layout": layout_seen}


def torch_losses(spec: dict, world: int) -> list[float]:
    if spec.get("deepspeed_data"):  # the reference the DeepSpeed run is held to
        from offload_bench import deepspeed_hybrid as dsh

        return dsh.torch_losses(1 + spec["steps"], world, lr=spec["lr"], hidden=spec["model"]["hidden"])
    model, data = build(spec), batches(spec, 1 + spec["steps"], world)
    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"])
    out = []
    for per_rank in data:
        opt.zero_grad()
        total = 0.0
        for x, y in per_rank:
            loss = lm_loss(model(x), y) / world
            loss.backward()
            total += float(loss)
        opt.step()
        out.append(total)
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    result = {"rank": rank, "world": world, "per_node": per_node, "group_rank": os.environ.get("GROUP_RANK")}
    try:
        if spec.get("probe_bytes"):
            result["rates"] = measure_rates(spec, rank, world, per_node)
        result["runs"] = {f"{layout}-{to}": train(spec, layout, to, rank, world)
                          for to in spec["offload"] for layout in ("world", "node")}
        if rank == 0:
            result["torch_losses"] = torch_losses(spec, world)
    finally:
        dist.destroy_process_group()
    Path(spec["out"], f"hybrid_rank{rank}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
