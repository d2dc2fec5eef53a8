"""`offload bench adam-reference`: the host update against torch's AdamW, element by element.

The engine's host update equals torch.optim.AdamW on the same CPU bit for bit,
and CUDA's AdamW to fp32 rounding only (Note [which AdamW the host update
equals] in offload/ops/adam.py). This measures the second part instead of
asserting it: the same parameters, gradients and hyperparameters go through
`offload.ops.adam.adam_step` on the host and through torch.optim.AdamW on
--device (its single-tensor, foreach and fused forms where that device has
them), for --steps steps with new gradients each step; after every step each
reference's parameters, exp_avg and exp_avg_sq are compared with the host's:
the share of elements that differ, the largest difference in units in the
last place (ulps, over the fp32 bit patterns) and the relative error
||host - torch|| / ||torch||. The ulp maximum alone misleads where a value
crosses zero: exp_avg, a running mean of gradients of either sign, has
elements near zero, where a difference of rounding flips the sign and spans
some 2^31 ulps; the relative error says how far apart the tensors are.

  offload bench adam-reference --device cuda --size 16M --steps 10
  offload bench adam-reference --device cpu      # expect 0 against the single-tensor form

Prints JSON; writes adam_reference.json and adam_reference.png under --out.
"""
from __future__ import annotations

import argparse

import torch

from offload_bench import common

FORMS = ("single", "foreach", "fused")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="where torch's AdamW runs: cpu or cuda (default cpu)")
    parser.add_argument("--size", type=common.parse_size, default=16_000_000, help="elements (default 16M)")
    parser.add_argument("--steps", type=int, default=10, help="steps, each with new gradients (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out", help="directory for adam_reference.json and .png")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps, over fp32 bit patterns mapped to a monotone integer line."""
    def line(x):
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    return (line(a) - line(b)).abs()


def compare(device: str, size: int, steps: int, seed: int = 0, hyper: dict | None = None) -> dict:
    """The host update against each form of torch's AdamW on `device`: per form and
    tensor, the share of differing elements and the largest ulp difference, over all
    steps (the worst step)."""
    from offload.ops.adam import adam_step, sqrt_source

    hyper = hyper or {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(size, generator=gen)
    grads = [torch.randn(size, generator=gen) * 10.0 ** float(torch.randint(-6, 1, (1,), generator=gen))
             for _ in range(steps)]
    host = {"p": p0.clone(), "m": torch.zeros(size), "v": torch.zeros(size)}
    refs = {}
    for form in FORMS:
        p = torch.nn.Parameter(p0.clone().to(dev))
        kw = {"foreach": form == "foreach"} if form != "fused" else {"fused": True}
        try:
            refs[form] = (p, torch.optim.AdamW([p], **hyper, **kw))
        except (RuntimeError, ValueError) as exc:  # a form this device or release lacks
            common.log(f"adam-reference: torch AdamW {form} on {dev}: {exc}")
    worst = {form: {t: {"share": 0.0, "max_ulps": 0, "rel_error": 0.0} for t in ("param", "exp_avg", "exp_avg_sq")}
             for form in refs}
    beta1, beta2 = hyper["betas"]
    for step, g in enumerate(grads, start=1):
        adam_step(host["p"], g, host["m"], host["v"], step=step, lr=hyper["lr"], beta1=beta1, beta2=beta2,
                  eps=hyper["eps"], weight_decay=hyper["weight_decay"], adamw_mode=True)
        for form, (p, opt) in refs.items():
            p.grad = g.to(dev)
            opt.step()
            state = opt.state[p]
            for name, ours, theirs in (("param", host["p"], p.detach()), ("exp_avg", host["m"], state["exp_avg"]),
                                       ("exp_avg_sq", host["v"], state["exp_avg_sq"])):
                theirs = theirs.cpu()
                d = _ulps(ours, theirs)
                w = worst[form][name]
                w["share"] = max(w["share"], float((d != 0).float().mean()))
                w["max_ulps"] = max(w["max_ulps"], int(d.max()))
                scale = float(theirs.double().norm()) or 1.0
                w["rel_error"] = max(w["rel_error"], float((ours.double() - theirs.double()).norm()) / scale)
    return {"device": str(dev), "size": size, "steps": steps, "hyperparameters": {**hyper, "betas": list(hyper["betas"])},
            "host_sqrt": sqrt_source(), "torch": torch.__version__, "worst_step": worst}


def _plot(result: dict, out_dir: str) -> None:
    plt = common.pyplot("adam_reference.png")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    forms = list(result["worst_step"])
    names = ("param", "exp_avg", "exp_avg_sq")
    for k, name in enumerate(names):
        shares = [100 * result["worst_step"][f][name]["share"] for f in forms]
        ax.bar([i + 0.25 * k for i in range(len(forms))], shares, width=0.25, label=name)
    ax.set_xticks([i + 0.25 for i in range(len(forms))], [f"torch {f} ({result['device']})" for f in forms])
    ax.set_ylabel("elements differing from the host update (%)")
    ax.set_title(f"{result['size']:,} elements, {result['steps']} steps, worst step")
    ax.legend()
    common.save_png(fig, out_dir, "adam_reference.png")


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        common.log("adam-reference: --device cuda, but CUDA is not available here")
        return 2
    result = {"benchmark": "adam-reference", "machine": common.machine_info(),
              **compare(args.device, args.size, args.steps, args.seed)}
    common.write_json(result, args.out, "adam_reference.json")  # and on stdout
    _plot(result, args.out)
    return 0
