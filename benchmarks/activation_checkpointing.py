"""Activation checkpointing: peak device-tier bytes and step time, with and without.

Trains offload_bench.gpt.GPT (parameters and optimizer state in host memory) for
a few steps three ways: no checkpointing, every Block checkpointed, and
Blocks checkpointed with cpu_checkpointing. Prints one JSON document (the
engine's device/host peaks, the median step time) and writes a PNG.

  python benchmarks/activation_checkpointing.py                       # defaults below
  python benchmarks/activation_checkpointing.py --layers 8 --seq 512 --out /tmp/ac
"""
import argparse
import sys
from pathlib import Path

# Run from a checkout, benchmark that checkout (not some other installed copy).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import offload  # noqa: E402
from offload_bench.common import (OtherLoad, log, machine_info, pyplot, save_png,  # noqa: E402
                                   time_median, write_json)
from offload_bench.gpt import GPT, GPTConfig  # noqa: E402

MODES = {
    "none": None,
    "checkpointed": {"modules": ["Block"]},
    "cpu_checkpointing": {"modules": ["Block"], "cpu_checkpointing": True},
}


def measure(args, mode: str) -> dict:
    torch.manual_seed(0)
    cfg_model = GPTConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                          max_seq=args.seq)
    model = GPT(cfg_model)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    }
    if MODES[mode] is not None:
        config["activation_checkpointing"] = MODES[mode]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    with offload.initialize(model, config) as engine:
        def step():
            logits = engine(x)
            engine.backward(F.cross_entropy(logits.float().reshape(-1, args.vocab), y.reshape(-1)))
            engine.step()

        step()  # warm-up, outside the peak
        engine.account.reset_peak()
        median, samples = time_median(step, repeats=args.steps, warmup=0)
        report = engine.memory_report()
    return {"device_peak_bytes": report["device"]["peak"], "host_peak_bytes": report["host"]["peak"],
            "step_s": round(median, 4), "step_samples_s": [round(s, 4) for s in samples],
            "params": cfg_model.num_params()}


def plot(result: dict, out_dir: str) -> None:
    plt = pyplot()
    if plt is None:
        log("matplotlib is missing: no PNG")
        return
    modes = list(result["modes"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(modes, [result["modes"][m]["device_peak_bytes"] / 2**20 for m in modes], color="tab:blue")
    left.set_ylabel("peak device-tier bytes (MiB)")
    left.set_title("saved activations on the device tier")
    right.bar(modes, [result["modes"][m]["step_s"] for m in modes], color="tab:orange")
    right.set_ylabel("median step time (s)")
    right.set_title("training step")
    shape = result["shape"]
    fig.suptitle(f"GPT {shape['layers']} layers, hidden {shape['hidden']}, seq {shape['seq']}, "
                 f"batch {shape['batch']} (offload_param cpu)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=12)
    save_png(fig, out_dir, "activation_checkpointing.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=None, help="directory for the JSON and PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = OtherLoad()
    result = {"machine": machine_info(),
              "shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab")},
              "modes": {}}
    for mode in MODES:
        log(f"activation checkpointing: {mode}")
        result["modes"][mode] = measure(args, mode)
    result["other_load_share"] = load.share()
    write_json(result, args.out, "activation_checkpointing.json")
    if args.out is not None:
        plot(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
