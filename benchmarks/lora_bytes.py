"""Bytes a LoRA's frozen base costs on each tier, against the closed form.

    python benchmarks/lora_bytes.py [--hidden 512 --layers 4 --vocab 8192 --rank 8] [--out DIR]

A Hugging Face Llama (random weights) with a PEFT LoRA (r=8 on q_proj, v_proj)
goes through `offload.initialize` in fp32 and bf16, with its parameters and
optimizer state on the host (cpu), on NVMe (nvme) and planned (auto); for each,
the homes and optimizer state on their tier (`engine.placement().held_bytes()`)
are compared with the closed form of Note [frozen parameters] in
offload/placement.py (c: the compute dtype's bytes; F frozen, T trainable
elements):

    F * c + T * (home + state)   home: c (0 for an fp32 host home: the master)
                                 state: 12 (8 for fp32 NVMe state: the home's file is the master)

and the NVMe bytes written per step (two steps of batch 1 x 32) with the
trainable state alone. Also the tier's whole charge per parameter (the fp32
gradients of the trainable parameters included). Prints one JSON object per
run and writes lora_bytes.json and lora_bytes.png under --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import peft
    import transformers

    import offload
    from offload.tiers import Tier

    llama = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                     intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=8, num_key_value_heads=4)
    rows = []
    with tempfile.TemporaryDirectory(prefix="offload-lora-bytes-") as nvme:
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            torch.manual_seed(0)
            model = peft.get_peft_model(transformers.LlamaForCausalLM(llama).to(dtype),
                                        peft.LoraConfig(r=args.rank, target_modules=["q_proj", "v_proj"]),
                                        autocast_adapter_dtype=False)
            frozen = sum(q.numel() for q in model.parameters() if not q.requires_grad)
            trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
            c = dtype.itemsize
            for where in ("cpu", "nvme", "auto"):
                side = {"device": where, **({"nvme_path": nvme} if where != "cpu" else {})}
                cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                             "offload_param": dict(side), "offload_optimizer": dict(side)}}
                if precision == "bf16":
                    cfg["bf16"] = {"enabled": True}
                with offload.initialize(copy.deepcopy(model), cfg) as engine:
                    plan = engine.placement()
                    tier = Tier.NVME if plan.uses(Tier.NVME) else Tier.HOST
                    charged = engine.account.usage(tier).now
                    ids = torch.randint(0, args.vocab, (1, 32))
                    before = sum(s.stats.bytes_written for s in engine.swap_stores)
                    for _ in range(2):
                        engine.backward(engine(input_ids=ids, labels=ids).loss)
                        engine.step()
                    written = (sum(s.stats.bytes_written for s in engine.swap_stores) - before) // 2
                on_host = tier is Tier.HOST
                home = 0 if (c == 4 and on_host) else c
                state = 8 if (c == 4 and not on_host) else 12
                closed = frozen * c + trainable * (home + state)
                rows.append({"precision": precision, "offload": where, "tier": tier.value, "frozen": frozen,
                             "trainable": trainable, "homes_and_state_bytes": plan.held_bytes()[tier],
                             "closed_form_bytes": closed, "equal": plan.held_bytes()[tier] == closed,
                             "tier_charged_bytes": charged,
                             "bytes_per_param": round(charged / (frozen + trainable), 3),
                             "nvme_written_per_step": written,
                             "trainable_state_bytes": 0 if on_host else trainable * (c + state)})
                print(json.dumps(rows[-1]), flush=True)
    result = {"model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "lora_rank": args.rank},
              "torch": torch.__version__, "runs": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lora_bytes.json").write_text(json.dumps(result, indent=1))
        _plot(rows, out / "lora_bytes.png")
    return 0 if all(r["equal"] for r in rows) else 1


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [f"{r['precision']}\n{r['offload']} ({r['tier']})" for r in rows]
    values = [r["bytes_per_param"] for r in rows]
    bars = ax.bar(names, values, color="#1f77b4")
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    ax.set_ylabel("bytes per parameter on the tier")
    ax.set_title("LoRA r=8 (q_proj, v_proj) of a Llama: the frozen base at its home size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
