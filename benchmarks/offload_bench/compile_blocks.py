"""`offload bench compile`: engine.compile() against plain torch compiled the same way.

For each model (the example GPT, a Hugging Face Llama, a Hugging Face Mixtral,
each small), precision, offload target and activation checkpointing on or
off, four runs of --steps training steps on the same batches:

  torch eager       plain PyTorch, AdamW
  torch compiled    the same, each block's forward torch.compile'd (--backend)
  ours eager        offload.initialize
  ours compiled     the same, engine.compile(backend=...) (Note [compiled blocks]
                    in offload/compile/blocks.py)

It records dynamo's graph breaks and unique graphs for both compiled runs, and
how far apart the losses are: ours compiled against torch compiled, and torch
compiled against torch eager, the tolerance torch itself shows. In bf16 plain
torch runs the engine's recipe (a bf16 copy computes, fp32 masters step).
Step times are `offload bench train --compile`'s (the bench beside it).

  offload bench compile --models gpt,llama,mixtral --precisions fp32,bf16 --offload cpu,nvme
  offload bench compile --quick

Prints JSON; writes compile_blocks.json and compile_blocks.png under --out.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import tempfile

import torch

from offload_bench import common

MODELS = ("gpt", "llama", "mixtral")
LR = 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="gpt,llama,mixtral", help=f"comma separated, of {', '.join(MODELS)}")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma separated: fp32, bf16")
    parser.add_argument("--offload", default="cpu,nvme", help="comma separated: cpu, nvme (parameters and state)")
    parser.add_argument("--checkpointing", default="off,on",
                        help="comma separated: off, on (the engine's activation checkpointing of the blocks)")
    parser.add_argument("--backend", default="aot_eager",
                        help="torch.compile backend (default aot_eager: AOTAutograd's graphs, no code generation)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="gpt only, fp32, cpu offload, both checkpointings")
    parser.add_argument("--out", default="bench_out", help="directory for compile_blocks.json and .png")


def _build(name: str):
    """(model, its block class name, a batch of token ids): small, seeded."""
    torch.manual_seed(0)
    if name == "gpt":
        from offload_bench.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=512, hidden=64, layers=2, heads=4, max_seq=32)), "Block", 512
    import transformers

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
        return model, "LlamaDecoderLayer", 128
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**shape, num_local_experts=4,
                                                                       num_experts_per_tok=2))
    return model, "MixtralDecoderLayer", 128


def _loss(model, tokens, hf: bool) -> torch.Tensor:
    if hf:
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss
    from offload_bench.gpt import lm_loss

    return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _torch_run(model, block_class, batches, precision, backend, hf):
    """Plain PyTorch with the engine's recipe: in bf16 a bf16 copy computes, its gradients
    step fp32 masters (AdamW, which the host update equals on this CPU), and the copy is
    refreshed from them; in fp32 the model itself."""
    masters = copy.deepcopy(model)
    compute = masters if precision == "fp32" else copy.deepcopy(model).to(torch.bfloat16)
    if backend is not None:
        for block in [m for m in compute.modules() if type(m).__name__ == block_class]:
            block.forward = torch.compile(type(block).forward.__get__(block), backend=backend)
    opt = torch.optim.AdamW(masters.parameters(), lr=LR, foreach=False)
    losses = []
    for tokens in batches:
        loss = _loss(compute, tokens, hf)
        loss.backward()
        if compute is not masters:
            for master, p in zip(masters.parameters(), compute.parameters()):
                master.grad = p.grad.float()
                p.grad = None
        opt.step()
        opt.zero_grad()
        if compute is not masters:
            with torch.no_grad():
                for master, p in zip(masters.parameters(), compute.parameters()):
                    p.copy_(master)
        losses.append(loss.item())
    return losses


def _ours_run(model, block_class, batches, precision, backend, hf, where, checkpointing, nvme_dir):
    import offload

    cfg = {"train_micro_batch_size_per_gpu": batches[0].shape[0],
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": where, "nvme_path": nvme_dir},
                                 "offload_optimizer": {"device": where, "nvme_path": nvme_dir}},
           "bf16": {"enabled": precision == "bf16"}}
    if checkpointing:
        cfg["activation_checkpointing"] = {"modules": [block_class]}
    losses = []
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        if backend is not None:
            engine.compile(backend=backend, modules=[block_class])
        for tokens in batches:
            loss = _loss(engine, tokens, hf)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _counted(run):
    """run()'s losses, and the graph breaks and unique graphs dynamo counted in it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    losses = run()
    return losses, sum(counters["graph_break"].values()), counters["stats"].get("unique_graphs", 0)


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def one_case(name, precision, where, checkpointing, backend, steps) -> dict:
    model, block_class, vocab = _build(name)
    hf = name != "gpt"
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (2, 17), generator=gen) for _ in range(steps)]
    with tempfile.TemporaryDirectory(prefix="offload-bench-compile-") as nvme_dir:
        torch_eager = _torch_run(model, block_class, batches, precision, None, hf)
        torch_compiled, torch_breaks, torch_graphs = _counted(
            lambda: _torch_run(model, block_class, batches, precision, backend, hf))
        ours_eager = _ours_run(model, block_class, batches, precision, None, hf, where, checkpointing, nvme_dir)
        ours_compiled, ours_breaks, ours_graphs = _counted(
            lambda: _ours_run(model, block_class, batches, precision, backend, hf, where, checkpointing, nvme_dir))
    two_recipes = False  # the same recipe in both precisions (_torch_run)
    return {"model": name, "block": block_class, "precision": precision, "offload": where,
            "checkpointing": checkpointing, "graph_breaks": {"torch": torch_breaks, "ours": ours_breaks},
            "unique_graphs": {"torch": torch_graphs, "ours": ours_graphs},
            "losses": {"torch_eager": torch_eager, "torch_compiled": torch_compiled, "ours_eager": ours_eager,
                       "ours_compiled": ours_compiled},
            "torch_compiled_vs_eager": _gap(torch_compiled, torch_eager),
            "ours_compiled_vs": ("ours eager" if two_recipes else "torch compiled"),
            "ours_compiled_gap": _gap(ours_compiled, ours_eager if two_recipes else torch_compiled)}


def _plot(result: dict, out_dir: str) -> None:
    plt = common.pyplot("compile_blocks.png")
    if plt is None:
        return
    cases = result["cases"]
    labels = [f"{c['model']} {c['precision']} {c['offload']}{' ckpt' if c['checkpointing'] else ''}" for c in cases]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(cases)), 4))
    xs = range(len(cases))
    ax.bar([x - 0.2 for x in xs], [c["graph_breaks"]["torch"] for c in cases], 0.4, label="plain torch, per block")
    ax.bar([x + 0.2 for x in xs], [c["graph_breaks"]["ours"] for c in cases], 0.4, label="engine.compile()")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("graph breaks")
    ax.set_title(f"graph breaks, blocks compiled ({result['backend']}), torch {result['torch']}")
    ax.legend()
    fig.tight_layout()
    common.save_png(fig, out_dir, "compile_blocks.png")


def run(args: argparse.Namespace) -> int:
    split = lambda text: [w.strip() for w in text.split(",") if w.strip()]  # noqa: E731
    models, precisions, wheres = split(args.models), split(args.precisions), split(args.offload)
    checkpointings = [w == "on" for w in split(args.checkpointing)]
    if args.quick:
        models, precisions, wheres = ["gpt"], ["fp32"], ["cpu"]
    bad = [m for m in models if m not in MODELS] + [p for p in precisions if p not in ("fp32", "bf16")] + [
        w for w in wheres if w not in ("cpu", "nvme")] + [w for w in split(args.checkpointing) if w not in ("off", "on")]
    if bad:
        common.log(f"compile: unknown {bad}; models {', '.join(MODELS)}, precisions fp32/bf16, offload cpu/nvme, "
                   "checkpointing off/on")
        return 2
    cases = []
    for name, precision, where, ckpt in itertools.product(models, precisions, wheres, checkpointings):
        case = one_case(name, precision, where, ckpt, args.backend, args.steps)
        common.log(f"  {name:<8} {precision} {where:<4} ckpt {'on ' if ckpt else 'off'}: graph breaks torch "
                   f"{case['graph_breaks']['torch']}, ours {case['graph_breaks']['ours']}; unique graphs "
                   f"{case['unique_graphs']['torch']}/{case['unique_graphs']['ours']}; loss gap ours vs "
                   f"{case['ours_compiled_vs']} {case['ours_compiled_gap']:.2e} (torch compiled vs eager "
                   f"{case['torch_compiled_vs_eager']:.2e})")
        cases.append(case)
    result = {"benchmark": "compile", "machine": common.machine_info(), "torch": torch.__version__,
              "backend": args.backend, "steps": args.steps, "cases": cases,
              "all_breaks_ours": sum(c["graph_breaks"]["ours"] for c in cases)}
    common.write_json(result, args.out, "compile_blocks.json")
    _plot(result, args.out)
    return 0
