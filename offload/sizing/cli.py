"""`offload estimate`: bytes per tier, and the minimum device, host and NVMe,
for a model size and a configuration, before anything is allocated (the
memory model: offload/sizing/memory_model.py)."""
from __future__ import annotations

import argparse
import json
import sys

from offload.config import ConfigError
from offload.sizing.memory_model import CLI_FLAGS, LARGEST_LAYER_FRACTION, _gib, estimate_from
from offload.sizing.step_time import format_predictions
from offload.sizing.trainable import parse_count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `offload estimate`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=parse_count, help="parameter count (7e9, 7B, 350M)")
    src.add_argument("--model-config", help="a Hugging Face config.json (GPT-2 or Llama style), or the model folder holding it")
    parser.add_argument("--config", help="offload / DeepSpeed JSON config (default: fp32, nothing offloaded)")
    parser.add_argument("--largest-layer", type=parse_count, default=None,
                        help="parameters of the largest module (default: from --model-config, "
                             f"else --params / {LARGEST_LAYER_FRACTION})")
    parser.add_argument("--persistent-params", type=parse_count, default=None,
                        help="parameters kept whole on every device (default: from --model-config, else 0)")
    parser.add_argument("--world-size", type=int, default=1, help="total ranks (default 1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="hosts the ranks run on (default 1)")
    parser.add_argument("--group-size", default=None,
                        help="ranks each parameter is partitioned over: node (each node a shard group, the "
                             "default), world (flat), or a number (default: the config's "
                             "zero_optimization.shard_group_size)")
    # A string, parsed by estimate(): its errors name the flag and every accepted form.
    parser.add_argument("--trainable", default=None,
                        help="how much trains, the rest frozen: a count (8M, 3.4e6), a fraction (0.011, 1.1%%), "
                             "or a PEFT LoRA adapter_config.json or its folder (with --model-config; the adapters "
                             "are added to the model). Default: all of it")
    parser.add_argument("--frozen-quant", choices=("nf4", "fp4", "int8"), default=None,
                        help="with --model-config: the frozen Linear weights (all but lm_head) quantized by "
                             "bitsandbytes, as a QLoRA base is loaded: nf4 or fp4 with double quantization, "
                             "or int8")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="with --model-config: also the bytes forward saves for backward at this sequence "
                             "length, the model's forward run on fake tensors (needs transformers)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="micro batch for --seq-len (default: the config's train_micro_batch_size_per_gpu, "
                             "else 1)")
    step = parser.add_argument_group("step time (Note [step-time model]): flat against hybrid sharding, "
                                     "predicted from the bytes above and these rates")
    step.add_argument("--step-time", action="store_true", help="predict a step's time for each layout")
    step.add_argument("--link-within", default="100GB", help="a rank's link within its node, bytes/s each way")
    step.add_argument("--link-across", default="12.5GB", help="a node's link to the others, bytes/s each way "
                                                             "(12.5GB: 100 Gb/s Ethernet)")
    step.add_argument("--bus", default=None, help="host <-> device bytes/s a rank (none: no separate device)")
    step.add_argument("--disk", default=None, help="a node's NVMe read rate, bytes/s")
    step.add_argument("--tflops", type=float, default=None, help="a rank's compute, TFLOP/s")
    step.add_argument("--adam-rate", type=float, default=None, help="parameters a second a rank's host Adam updates")
    step.add_argument("--tokens", type=int, default=None, help="a rank's tokens a step")
    step.add_argument("--no-overlap", action="store_true", help="transfers run in series with compute (the "
                                                                "cpu layer), not under it")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Runs `offload estimate`; 0 when the plan fits, 1 when it does not (what is short, on stderr),
    2 on a bad config or argument (message on stderr)."""
    try:
        est = estimate_from(args.params, model_config=args.model_config, config=args.config,
                        largest_layer_params=args.largest_layer, persistent_params=args.persistent_params,
                        world_size=args.world_size, num_nodes=args.num_nodes,
                        trainable=args.trainable, names=CLI_FLAGS, frozen_quant=args.frozen_quant,
                        group_size=args.group_size)
        saved = _activations(args)
        predictions = _step_time(args, est)
    except ConfigError as exc:
        print(f"offload estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**est.to_dict(), "activations": None if saved is None else saved.to_dict(),
                          "step_time": None if predictions is None else
                          {k: p.to_dict() for k, p in predictions.items()}}, indent=2))
    else:
        print(est.format())
        if saved is not None:
            print(f"\nsaved activations per rank, micro batch {args.batch_size} x {args.seq_len} tokens "
                  f"(Note [activation estimate]): {_gib(saved.whole)} with every block whole; "
                  f"{_gib(saved.checkpointed)} with all {saved.blocks} checkpointed (a block saves "
                  f"{_gib(saved.block)}, its input {_gib(saved.block_input)}, outside the blocks {_gib(saved.outside)})")
        if predictions is not None:
            print("\nstep time per layout (Note [step-time model]; a prediction from the rates given):")
            print(format_predictions(predictions))
    # A plan that does not fit exits 1, so a script can stop before it starts a run initialize refuses.
    short = [n for n in est.notes if " short" in n]
    if args.config is not None:
        from offload.config import Config

        short = est.check_budgets(Config.load(args.config).memory) + short
    for line in short:
        print(f"offload estimate: does not fit: {line}", file=sys.stderr)
    return 1 if short else 0


def _step_time(args: argparse.Namespace, est):
    """Flat and hybrid step times where --step-time asks for them; None else."""
    if not args.step_time:
        return None
    from offload.config import parse_bytes
    from offload.sizing.step_time import Rates, Work, compare_layouts

    missing = [flag for flag, v in (("--tflops", args.tflops), ("--adam-rate", args.adam_rate),
                                    ("--tokens", args.tokens)) if v is None]
    if missing:
        raise ConfigError(f"--step-time needs {', '.join(missing)}")
    rate = {flag: None if v is None else parse_bytes(v, flag) for flag, v in (
        ("--link-within", args.link_within), ("--link-across", args.link_across), ("--bus", args.bus),
        ("--disk", args.disk))}
    nvme = "nvme"
    try:
        rates = Rates(within_node=rate["--link-within"], across_nodes=rate["--link-across"], bus=rate["--bus"],
                      disk=rate["--disk"], flops=args.tflops * 1e12, adam=args.adam_rate,
                      overlap=not args.no_overlap)
        from offload.config import Config

        cfg = Config() if args.config is None else Config.load(args.config)
        work = Work(params=est.num_params, trainable=est.trainable_params, param_bytes=est.param_bytes,
                    accumulation=cfg.gradient_accumulation_steps or 1,
                    tokens=args.tokens, world=est.world_size, nodes=est.num_nodes, group=est.group_size,
                    params_offloaded=est._side("param") != "none", params_on_nvme=est.breakdown["nvme"] != {}
                    and est._side("param") in (nvme, "auto"), state_on_nvme=est._side("optimizer") == nvme)
        return compare_layouts(work, rates)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _activations(args: argparse.Namespace):
    """The activation estimate where --seq-len asks for it; None else."""
    if args.seq_len is None:
        if args.batch_size is not None:
            raise ConfigError("--batch-size is the micro batch of --seq-len's activation estimate: give --seq-len")
        return None
    if args.model_config is None:
        raise ConfigError("--seq-len: the activation estimate runs the model's forward: give --model-config")
    from offload.config import Config
    from offload.sizing.activations import hf_activation_bytes

    cfg = Config() if args.config is None else Config.load(args.config)
    if args.batch_size is None:
        args.batch_size = cfg.train_micro_batch_size_per_gpu or 1
    for flag, v in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
        if v < 1:
            raise ConfigError(f"{flag}: {v} is not a positive integer")
    return hf_activation_bytes(args.model_config, batch=args.batch_size, seq=args.seq_len,
                               dtype=cfg.precision.dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload estimate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))

