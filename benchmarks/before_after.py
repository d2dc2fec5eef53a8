"""`offload bench train` on the code of another commit and on this tree, in turn, in one run.

    git worktree add /tmp/before <commit>   # and copy offload/_C*.so there if csrc is unchanged
    python benchmarks/before_after.py --before /tmp/before [--rounds 6] [--devices cpu,sim]
                                      [--cpu 1] [--out DIR] [-- extra bench train arguments]

Each round runs the bench on the other tree first, then on this one, per device
(`--quick`, the offload-cpu and offload-nvme contenders, `--steps 20` unless the
extra arguments say otherwise), each bench in a fresh interpreter importing its own
tree (PYTHONPATH), pinned to the processor `--cpu` names (taskset) so that both see
the same core. Per contender and device it keeps each round's median step and the
ratio this/before round by round: a change in the engine's own overhead shows in
the ratios' median, the machine's drift cancels within a round.

Prints JSON and writes before_after.json and before_after.png under --out (each
bench's own output under --out/runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def bench(tree: Path, device: str, out: Path, cpu: str | None, extra: list[str]) -> dict[str, float]:
    """{contender: median step seconds} of one `offload bench train` run on `tree`."""
    args = extra or ["--quick", "--contenders", "offload-cpu,offload-nvme", "--steps", "20"]
    cmd = [sys.executable, "-m", "offload", "bench", "train", "--device", device, *args, "--out", str(out)]
    if cpu is not None:
        cmd = ["taskset", "-c", cpu, *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"bench train on {tree} ({device}) failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    results = json.loads((out / "train.json").read_text())["results"]
    return {name: statistics.median(s["step_s"] for s in r["timeline_per_step"])
            for name, r in results.items() if r.get("timeline_per_step")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other commit's tree (a git worktree)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--devices", default="cpu,sim")
    parser.add_argument("--cpu", default=None, help="taskset's processor list for every bench (default: none)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/before_after"))
    parser.add_argument("extra", nargs="*", help="after --: bench train's own arguments")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before.resolve(), "now": HERE}
    steps: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for which, tree in trees.items():
            for device in args.devices.split(","):
                run_dir = args.out / "runs" / f"{which}_{device}_r{r + 1}"
                medians = bench(tree, device, run_dir, args.cpu, args.extra)
                for name, s in medians.items():
                    steps.setdefault(f"{device} {name}", {"before": [], "now": []})[which].append(s)
    cases = {}
    for case, v in steps.items():
        ratios = [n / b for n, b in zip(v["now"], v["before"])]
        cases[case] = {"before_step_s": [round(x, 5) for x in v["before"]],
                       "now_step_s": [round(x, 5) for x in v["now"]],
                       "now_over_before": [round(x, 3) for x in ratios],
                       "median_ratio": round(statistics.median(ratios), 3)}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    before = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=trees["before"], capture_output=True,
                            text=True)
    report = {"benchmark": "before_after", "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "now": head.stdout.strip(), "before": before.stdout.strip(), "rounds": args.rounds,
              "cpu_pinned": args.cpu, "cases": cases}
    (args.out / "before_after.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (case, c) in enumerate(cases.items()):
        ax.scatter([i] * len(c["now_over_before"]), c["now_over_before"], s=14, alpha=0.6)
        ax.plot([i - 0.25, i + 0.25], [c["median_ratio"]] * 2, color="black")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(cases)), list(cases), fontsize=8)
    ax.set_ylabel("step time, now / before (per round)")
    ax.set_title(f"bench train: {report['now']} against {report['before']}, {args.rounds} rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "before_after.png", dpi=120)


if __name__ == "__main__":
    main()
