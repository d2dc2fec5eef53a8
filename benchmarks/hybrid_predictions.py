"""Predictions on paper: Llama-3-70B on 2 nodes x 8 GPUs joined by 100 Gb/s, flat against hybrid.

    python benchmarks/hybrid_predictions.py [--out DIR] [--link-across 12.5GB] [--link-within 450GB]
                                            [--bus 50GB] [--tflops 400] [--adam-rate 1e9] [--tokens 4096]

Nothing runs on such a machine here: each figure is offload's memory model
(`offload estimate`) and its step-time model (Note [step-time model] in
offload/sizing/step_time.py) for the rates given, which are assumptions stated in
the JSON beside the figures:
  --link-across  a node's link to the other: 100 Gb/s Ethernet, 12.5 GB/s each way
  --link-within  a GPU's NVLink 4 to the others of its node, 450 GB/s each way
  --bus          a GPU's PCIe Gen5 x16, about 50 GB/s each way
  --tflops       a GPU's bf16 compute at about 40% of an H100's dense peak
  --adam-rate    a rank's host Adam in the step: 1.06-1.13 Gparam/s measured on a 16-core
                 H200 host (benchmarks/RESULTS.md), taken as each rank's with as many cores
Two jobs, both bf16 with offload_param and offload_optimizer on the host, a micro batch of
--tokens a rank:
  full       every parameter trained (70.55B), a window of 1 micro-step and of 8
  qlora      a LoRA (r 8 on q_proj and v_proj) on an nf4 base (`frozen.quantize`), a window of 1
For each: bytes per rank per tier and the optimizer step (the window) per layout, the
bound named.
Prints JSON; writes hybrid_predictions.json and .png under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from offload_bench.common import pyplot, save_png, write_json  # noqa: E402
from offload_bench.lora import LLAMA3_70B, LORA  # noqa: E402
from offload.config import parse_bytes  # noqa: E402
from offload.sizing import estimate  # noqa: E402
from offload.sizing.step_time import Rates, Work, compare_layouts  # noqa: E402

CONFIG = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}}}
WORLD, NODES = 16, 2


def job(kind: str, rates: Rates, tokens: int, accumulation: int = 1) -> dict:
    model = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LLAMA3_70B}
    extra = {} if kind == "full" else {"trainable": {"peft_type": "LORA", **LORA}, "frozen_quant": "nf4"}
    out = {}
    for layout in ("world", "node"):
        est = estimate(model_config=model, config=CONFIG, world_size=WORLD, num_nodes=NODES, group_size=layout,
                       **extra)
        out[layout] = {"group_size": est.group_size, "host_per_rank": est.host, "device_per_rank": est.device,
                       "host_per_node": est.minimum_host}
    work = Work(params=est.num_params, trainable=est.trainable_params, param_bytes=est.param_bytes,
                tokens=tokens, world=WORLD, nodes=NODES, group=est.group_size, accumulation=accumulation)
    predictions = compare_layouts(work, rates)
    return {"params": est.num_params, "trainable": est.trainable_params, "param_bytes": est.param_bytes,
            "accumulation": accumulation,
            "memory": {"flat": out["world"], "hybrid": out["node"]},
            "step": {k: p.to_dict() for k, p in predictions.items()},
            "hybrid_over_flat": predictions["hybrid"].step / predictions["flat"].step}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--link-across", default="12.5GB")
    p.add_argument("--link-within", default="450GB")
    p.add_argument("--bus", default="50GB")
    p.add_argument("--tflops", type=float, default=400.0)
    p.add_argument("--adam-rate", type=float, default=1.0e9)
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args(argv)
    rates = Rates(within_node=parse_bytes(args.link_within), across_nodes=parse_bytes(args.link_across),
                  bus=parse_bytes(args.bus), flops=args.tflops * 1e12, adam=args.adam_rate, overlap=True)
    result = {"what": "predictions, not measurements", "rates_assumed": rates.__dict__, "tokens_per_rank": args.tokens,
              "ranks": WORLD, "nodes": NODES, "config": CONFIG,
              "jobs": {f"{kind}, window of {a}": job(kind, rates, args.tokens, a)
                       for kind, a in (("full", 1), ("full", 8), ("qlora", 1))}}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(result, args.out, "hybrid_predictions.json")
        plot(result, args.out)
    return 0


def plot(result: dict, out) -> None:
    plt = pyplot("hybrid_predictions.png")
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for ax, (kind, r) in zip(axes, result["jobs"].items()):
        layouts = list(r["step"])
        terms = sorted({t for p in r["step"].values() for t in p["terms"]})
        width = 0.8 / len(terms)
        for i, term in enumerate(terms):
            ax.bar([x + i * width for x in range(len(layouts))],
                   [r["step"][lay]["terms"].get(term, 0.0) for lay in layouts], width, label=term)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(layouts))], layouts)
        ax.set_title(f"70B {kind}: step {r['step']['flat']['step']:.2f} s flat, "
                     f"{r['step']['hybrid']['step']:.2f} s hybrid")
        ax.set_ylabel("seconds (predicted)")
        ax.legend(fontsize=7)
    fig.suptitle("Predicted, 2 nodes x 8 GPUs, 100 Gb/s between nodes")
    save_png(fig, out, "hybrid_predictions.png")


if __name__ == "__main__":
    sys.exit(main())
