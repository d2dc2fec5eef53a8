"""Two nodes of two ranks on one machine: flat against hybrid sharding, measured and predicted.

    python benchmarks/hybrid_sharding.py --out DIR [--hidden 512] [--layers 4] [--micro 1] [--seq 16]
                                         [--steps 6] [--offload cpu [nvme]] [--deepspeed] [--ds-steps 3]

Starts two `torchrun --nnodes 2 --nproc-per-node 2` launches on this host, node ranks 0
and 1, one rendezvous: four gloo ranks on the cpu layer, the two launches two nodes
(Note [node names] in offload/node.py: torchrun's GROUP_RANK tells them apart). Each
rank (offload_bench/hybrid.py) measures the rates where it stands, then trains the
GPT flat (shard_group_size "world") and hybrid ("node") with the --offload tiers, and
rank 0 plain PyTorch on the global batch.

From the measured rates, offload's step-time model (Note [step-time model] in
offload/sizing/step_time.py) predicts each layout's step, here with overlap off:
the cpu layer runs compute, collectives and the host Adam in turn. Reported per
layout: the median step measured and predicted, their ratio, the bound named, the
bytes a rank's collectives carried in a step per link class (Note [link classes])
and the losses against plain PyTorch.

--deepspeed also runs DeepSpeed ZeRO-3 with hpZ (zero_hpz_partition_size 2) and cpu
then nvme offload, and hpz 1 as the control, on the same two launches
(offload_bench/deepspeed_hybrid.py), and this engine on that script's model, losses
against plain PyTorch each.

Prints JSON, writes hybrid_sharding.json and hybrid_sharding.png under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from offload_bench.common import machine_info, pyplot, save_png, write_json  # noqa: E402
from offload.sizing.step_time import Rates, Work, predict  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(module_args: list[str], out: Path, timeout: float) -> list[int]:
    """Two torchrun launches, node ranks 0 and 1, running `python -m offload_bench.hybrid ARGS`."""
    port, procs = _port(), []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop("OFFLOAD_NODE", None)  # the nodes are torchrun's
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", *module_args]
        log = open(out / f"launch{node}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, codes = time.monotonic() + timeout, []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    return codes


def predicted(rates: dict, spec: dict, params: int, layout: str, offload_to: str) -> dict:
    """Note [step-time model] with the rates measured: each rank's median."""
    work = Work(params=params, trainable=params, param_bytes=4 * params, tokens=spec["micro"] * spec["seq"],
                world=4, nodes=2, group=4 if layout == "world" else 2,
                params_on_nvme=offload_to == "nvme", state_on_nvme=offload_to == "nvme")
    r = Rates(within_node=rates["within_node"], across_nodes=rates["across_nodes"], flops=rates["flops"],
              adam=rates["adam"], disk=rates.get("disk"), overlap=False)
    return predict(work, r).to_dict()


def run_ours(spec: dict, out: Path, timeout: float) -> dict:
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    codes = launch_two_nodes(["offload_bench.hybrid", str(spec_path)], out, timeout)
    ranks = [json.loads((out / f"hybrid_rank{r}.json").read_text()) for r in range(4)
             if (out / f"hybrid_rank{r}.json").exists()]
    if not spec.get("probe_bytes"):
        return {"ranks": ranks} if codes == [0, 0] and len(ranks) == 4 else {"error": f"exit codes {codes}"}
    if codes != [0, 0] or len(ranks) != 4:
        tail = {n: (out / f"launch{n}.log").read_text()[-3000:] for n in (0, 1)}
        return {"error": f"launch exit codes {codes}, {len(ranks)} rank results", "log_tail": tail}
    rates = {k: statistics.median(r["rates"][k] for r in ranks) for k in ranks[0]["rates"]}
    return {"ranks": ranks, "rates": rates}


def summarize(spec: dict, ours: dict) -> dict:
    from offload_bench.hybrid import build

    params = sum(p.numel() for p in build(spec).parameters())
    rank0, rates = ours["ranks"][0], ours["rates"]
    rows = {}
    for name, run in rank0["runs"].items():
        layout, offload_to = name.split("-")
        measured = statistics.median(statistics.median(r["runs"][name]["step_s"]) for r in ours["ranks"])
        pred = predicted(rates, spec, params, layout, offload_to)
        losses, ref = run["losses"], rank0["torch_losses"]
        rows[name] = {"layout": run["layout"], "measured_step_s": measured, "predicted_step_s": pred["step"],
                      "measured_over_predicted": measured / pred["step"], "bound": pred["bound"],
                      "terms_s": pred["terms"], "model_wire_bytes": pred["bytes"],
                      "counted_bytes_per_step": run["bytes_per_step"], "losses": losses, "torch_losses": ref,
                      "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref))}
    return {"params": params, "rates": rates, "layouts": rows}


def plot(result: dict, out: Path) -> None:
    plt = pyplot("hybrid_sharding.png")
    if plt is None:
        return
    rows = result["ours"]["layouts"]
    names = list(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(names))
    a.bar([x - 0.2 for x in xs], [rows[n]["measured_step_s"] for n in names], 0.4, label="measured")
    a.bar([x + 0.2 for x in xs], [rows[n]["predicted_step_s"] for n in names], 0.4, label="predicted")
    a.set_xticks(list(xs), names)
    a.set_ylabel("median step (s)")
    a.legend()
    across = [sum(k["bytes_sent"] + k["bytes_received"]
                  for k in rows[n]["counted_bytes_per_step"]["across_nodes"].values()) / 2**20 for n in names]
    b.bar(list(xs), across)
    b.set_xticks(list(xs), names)
    b.set_ylabel("MiB a rank sends + receives across nodes, a step")
    fig.suptitle("2 nodes x 2 ranks on one machine (gloo, cpu layer)")
    save_png(fig, out, "hybrid_sharding.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--offload", nargs="+", default=["cpu"], choices=("cpu", "nvme"))
    p.add_argument("--probe-mib", type=int, default=64, help="bytes of the link probes' all_gather")
    p.add_argument("--deepspeed", action="store_true")
    p.add_argument("--ds-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(out), "seed": 0, "lr": 1e-3, "micro": args.micro, "seq": args.seq, "steps": args.steps,
            "offload": args.offload, "probe_bytes": args.probe_mib << 20, "probe_repeats": 5,
            "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
                      "heads": max(1, args.hidden // 64)}}
    result = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "spec": spec,
              "command": "python benchmarks/hybrid_sharding.py " + " ".join(argv or sys.argv[1:])}
    ours = run_ours(spec, out, args.timeout)
    result["ours"] = summarize(spec, ours) if "error" not in ours else ours
    if args.deepspeed:
        result["deepspeed"] = run_deepspeed(out, args.ds_steps, args.timeout)
    write_json(result, out, "hybrid_sharding.json")
    if "error" not in ours:
        plot(result, out)
    print(json.dumps(result, indent=1))
    return 0 if "error" not in ours else 1


DS_RUNS = (("cpu", 2, False), ("nvme", 2, False), ("nvme-optimizer", 2, False), ("cpu", 1, False),
           ("nvme", 1, False), ("nvme", 1, True))  # offload, hpZ group, zero.Init first


def run_deepspeed(out: Path, steps: int, timeout: float) -> dict:
    """DeepSpeed ZeRO-3 with hpZ and offload, and hpz 1 as the control, on the two launches;
    then this engine on the same model and batches, hybrid and flat."""
    from offload_bench import deepspeed_hybrid as dsh

    runs = {}
    for offload_to, hpz, zero_init in DS_RUNS:
        name = f"{offload_to}-hpz{hpz}" + ("-zero.Init" if zero_init else "")
        d = out / f"deepspeed-{name}"
        d.mkdir(exist_ok=True)
        r = dsh.run_two_nodes(d, offload=offload_to, hpz=hpz, steps=steps, timeout=timeout, zero_init=zero_init)
        runs[name] = {k: r.get(k) for k in ("ok", "losses", "torch_losses", "max_abs_diff", "assert_close",
                                            "step_times_s", "return_codes", "rank_errors", "hpz_evidence_rank0")}
    ours = {}
    for offload_to in ("cpu", "nvme"):
        d = out / f"ours-deepspeed-model-{offload_to}"
        d.mkdir(exist_ok=True)
        spec = {"out": str(d), "seed": 0, "lr": 1e-3, "micro": dsh.MICRO, "seq": dsh.SEQ, "steps": steps - 1,
                "offload": [offload_to], "deepspeed_data": True,
                "model": {"vocab": dsh.VOCAB, "hidden": dsh.model_hidden(offload_to), "layers": dsh.LAYERS,
                          "heads": dsh.HEADS}}
        got = run_ours(spec, d, timeout)
        if "error" in got:
            ours[offload_to] = got
            continue
        rank0 = got["ranks"][0]
        ours[offload_to] = {name: {"losses": run["losses"], "torch_losses": rank0["torch_losses"],
                                   "max_abs_diff": max(abs(a - b) for a, b in zip(run["losses"],
                                                                                   rank0["torch_losses"])),
                                   "median_step_s": run["median_step_s"]}
                            for name, run in rank0["runs"].items()}
    return {"deepspeed": runs, "ours_same_work": ours}


if __name__ == "__main__":
    sys.exit(main())
