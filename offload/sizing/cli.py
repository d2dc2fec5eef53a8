"""`offload estimate`: bytes per tier, and the minimum device, host and NVMe,
for a model size and a configuration, before anything is allocated (the
memory model: offload/sizing/memory_model.py)."""
from __future__ import annotations

import argparse
import json
import sys

from offload.config import ConfigError
from offload.sizing.memory_model import CLI_FLAGS, LARGEST_LAYER_FRACTION, _gib, estimate_from
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
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Runs `offload estimate`; 0 when the plan fits, 1 when it does not (what is short, on stderr),
    2 on a bad config or argument (message on stderr)."""
    try:
        est = estimate_from(args.params, model_config=args.model_config, config=args.config,
                        largest_layer_params=args.largest_layer, persistent_params=args.persistent_params,
                        world_size=args.world_size, num_nodes=args.num_nodes,
                        trainable=args.trainable, names=CLI_FLAGS, frozen_quant=args.frozen_quant)
        saved = _activations(args)
    except ConfigError as exc:
        print(f"offload estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**est.to_dict(), "activations": None if saved is None else saved.to_dict()}, indent=2))
    else:
        print(est.format())
        if saved is not None:
            print(f"\nsaved activations per rank, micro batch {args.batch_size} x {args.seq_len} tokens "
                  f"(Note [activation estimate]): {_gib(saved.whole)} with every block whole; "
                  f"{_gib(saved.checkpointed)} with all {saved.blocks} checkpointed (a block saves "
                  f"{_gib(saved.block)}, its input {_gib(saved.block_input)}, outside the blocks {_gib(saved.outside)})")
    # A plan that does not fit exits 1, so a script can stop before it starts a run initialize refuses.
    short = [n for n in est.notes if " short" in n]
    if args.config is not None:
        from offload.config import Config

        short = est.check_budgets(Config.load(args.config).memory) + short
    for line in short:
        print(f"offload estimate: does not fit: {line}", file=sys.stderr)
    return 1 if short else 0


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

