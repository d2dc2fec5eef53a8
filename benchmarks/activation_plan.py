"""Activations in the plan (Note [activations in the plan] in offload/activations/plan.py),
and the activation estimate against what the engine measures (Note [activation estimate]).

    python benchmarks/activation_plan.py [--steps 6] [--budget-over-state 1.25] [--out DIR]

Part 1, on the simulated device (OFFLOAD_DEVICE=sim, compute timed at
OFFLOAD_SIM_TFLOPS): a GPT (benchmarks/offload_bench/gpt.py) with offload_param and
offload_optimizer "auto" under a memory.device_budget that holds its training state
(16 bytes a parameter) but not the state and every block's activations: the state's
bytes x --budget-over-state.
  - before: the same config with activation_checkpointing.auto false (the engine
    without the plan): refused at the first forward;
  - planned: what the plan chose, its device peak, and its step time against the
    same model under a budget that holds everything (roomy), steps interleaved;
  - losses of both against plain PyTorch on the same batches.
Part 2, on the host (OFFLOAD_DEVICE=cpu): the activation estimate (the model's
forward on fake tensors) against the engine's measured peak of saved activations,
for the GPT, a Hugging Face Llama and a Hugging Face Mixtral, at two sequence
lengths (needs transformers).

Prints JSON and writes activation_plan.json and activation_plan.png under --out.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offload_bench.common import machine_info, pyplot, save_png, write_json  # noqa: E402


def _config(budget, auto=True):
    return {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                  "offload_optimizer": {"device": "auto"}},
            "memory": {"device_budget": budget}, "activation_checkpointing": {"auto": auto}}


def plan_on_sim(args) -> dict:
    import torch

    import offload
    from offload_bench.gpt import GPT, GPTConfig, lm_loss

    os.environ["OFFLOAD_DEVICE"] = "sim"
    gpt = GPTConfig(vocab_size=2048, hidden=256, layers=8, heads=8, max_seq=args.seq)
    torch.manual_seed(0)
    model = GPT(gpt)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, gpt.vocab_size, (8, args.seq), generator=gen),
             torch.randint(0, gpt.vocab_size, (8, args.seq), generator=gen)) for _ in range(args.steps)]
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    ref_losses = []
    for x, y in data:
        loss = lm_loss(reference(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    roomy_budget = 64 * 16 * params
    with offload.initialize(copy.deepcopy(model), _config(roomy_budget)) as probe:
        x, y = data[0]
        probe.backward(lm_loss(probe(x), y))
        probe.step()
        roomy_peak = probe.memory_report()["device"]["peak"]
    budget = int(args.budget_over_state * 16 * params)
    try:
        with offload.initialize(copy.deepcopy(model), _config(budget, auto=False)) as before:
            x, y = data[0]
            before.backward(lm_loss(before(x), y))
            before.step()
        before_result = "trained"
    except MemoryError as e:
        before_result = "refused: " + str(e).split(";")[0]

    engines = {"planned": offload.initialize(copy.deepcopy(model), _config(budget)),
               "roomy": offload.initialize(copy.deepcopy(model), _config(roomy_budget))}
    times = {k: [] for k in engines}
    losses = {k: [] for k in engines}
    plans = []
    try:
        for i, (x, y) in enumerate(data):
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for key in order:
                engine = engines[key]
                t = time.perf_counter()
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                times[key].append(time.perf_counter() - t)
                losses[key].append(loss.item())
            plans.append(engines["planned"].activation_report()["plan"]["said"])
        report = engines["planned"].activation_report()["plan"]
        peaks = {k: e.memory_report()["device"]["peak"] for k, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
    median = {k: statistics.median(v[2:]) for k, v in times.items()}  # after the measuring steps
    return {"model": {"params": params, "hidden": gpt.hidden, "layers": gpt.layers, "batch": 8, "seq": args.seq},
            "training_state_bytes": 16 * params, "roomy_budget": roomy_budget, "roomy_device_peak": roomy_peak,
            "budget": budget, "before": before_result, "plan_each_step": plans, "plan": report,
            "device_peak": peaks, "step_s_median": median, "step_s": times,
            "planned_over_roomy": median["planned"] / median["roomy"],
            "losses": losses, "torch_losses": ref_losses,
            "max_loss_diff_vs_torch": {k: max(abs(a - b) for a, b in zip(v, ref_losses)) for k, v in losses.items()}}


def estimate_against_measured(seqs) -> list[dict]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    import offload
    from offload.sizing.activations import activation_bytes
    from offload_bench.gpt import GPT, GPTConfig

    os.environ["OFFLOAD_DEVICE"] = "cpu"
    import transformers

    class GPTWithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = GPT(GPTConfig(vocab_size=512, hidden=128, layers=4, heads=4, max_seq=max(seqs)))

        def forward(self, x, y):
            return F.cross_entropy(self.gpt(x).reshape(-1, 512), y.reshape(-1))

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
    models = {"GPT": (GPTWithLoss, None),
              "Llama (Hugging Face)": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)),
              "Mixtral (Hugging Face MoE)": (transformers.MixtralForCausalLM,
                                             transformers.MixtralConfig(**common, num_local_experts=4,
                                                                        num_experts_per_tok=2))}
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}
    rows = []
    for name, (cls, config) in models.items():
        def make():
            return cls() if config is None else cls(config)
        for seq in seqs:
            x = torch.randint(0, 512, (4, seq), generator=torch.Generator().manual_seed(seq))
            inputs, kwargs = ((x, x), {}) if config is None else ((x,), {"labels": x})
            with torch.device("meta"):
                on_meta = make().train()
            t = time.perf_counter()
            est = activation_bytes(on_meta, *inputs, **kwargs)
            est_s = time.perf_counter() - t
            torch.manual_seed(0)
            with offload.initialize(make(), cfg) as engine:
                saver = engine.activation_checkpointing.saver
                saver.reset_peak()
                out = engine(*inputs, **kwargs)
                engine.backward(out if isinstance(out, torch.Tensor) else out.loss)
                measured = saver.device_peak
            rows.append({"model": name, "batch": 4, "seq": seq, "estimated": est.whole, "measured": measured,
                         "ratio": est.whole / measured, "estimated_checkpointed": est.checkpointed,
                         "estimate_s": round(est_s, 3)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--budget-over-state", type=float, default=1.25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    plan = plan_on_sim(args)
    rows = estimate_against_measured([128, 512])
    report = {"benchmark": "activation_plan", "command": " ".join(["activation_plan.py"] + (argv or sys.argv[1:])),
              "machine": machine_info(), "sim": plan, "estimate": rows}
    write_json(report, args.out, "activation_plan.json")
    plt = pyplot("activation_plan.png")
    if plt is not None and args.out is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
        keys = ["roomy", "planned"]
        a.bar(keys, [plan["step_s_median"][k] for k in keys], color=["C0", "C1"])
        for i, k in enumerate(keys):
            a.annotate(f"peak {plan['device_peak'][k] / 2**20:.0f} MiB", (i, plan["step_s_median"][k]),
                       ha="center", va="bottom", fontsize=8)
        a.set_ylabel("step, s (median, sim)")
        a.set_title(f"budget {plan['budget'] / 2**20:.0f} MiB: {plan['plan']['said']}", fontsize=8)
        labels = [f"{r['model'].split(' ')[0]} {r['seq']}" for r in rows]
        xs = range(len(rows))
        b.bar([i - 0.2 for i in xs], [r["measured"] / 2**20 for r in rows], width=0.4, label="measured (engine)")
        b.bar([i + 0.2 for i in xs], [r["estimated"] / 2**20 for r in rows], width=0.4, label="estimated")
        b.set_xticks(list(xs), labels, rotation=30, fontsize=8)
        b.set_ylabel("saved activations, MiB")
        b.legend(fontsize=8)
        save_png(fig, args.out, "activation_plan.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
