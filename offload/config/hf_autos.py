"""The "auto" values of Hugging Face's DeepSpeed configs, named all at once.

Note [Hugging Face autos]
The ZeRO-3 config in Hugging Face's DeepSpeed guide leaves a dozen values
"auto": its Trainer integration fills each in from TrainingArguments before
DeepSpeed reads the config. offload.initialize reads the config as written,
so what only the Trainer knows (the learning rate, the clipping norm, the
batch size) is not there. Refusing the first one found sends a user back
a dozen times; instead every such "auto" is named in one error, each with
the TrainingArguments field it stands for, before any section is built.
The autos offload resolves itself (the bucket and persistence sizes from
the model, a batch size the other two determine: Config.resolve_auto) are
not listed.
"""
from __future__ import annotations

from typing import Any, Mapping

# Dotted key -> what Hugging Face's Trainer fills it in from.
TRAINER_FILLS = {
    "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size",
    "gradient_clipping": "TrainingArguments.max_grad_norm",
    "optimizer.params.lr": "TrainingArguments.learning_rate",
    "optimizer.params.betas": "[TrainingArguments.adam_beta1, TrainingArguments.adam_beta2]",
    "optimizer.params.eps": "TrainingArguments.adam_epsilon",
    "optimizer.params.weight_decay": "TrainingArguments.weight_decay",
    "scheduler.params.warmup_min_lr": "0 (what the Trainer puts there)",
    "scheduler.params.warmup_max_lr": "TrainingArguments.learning_rate",
    "scheduler.params.warmup_num_steps": "TrainingArguments.warmup_steps (or warmup_ratio x the training steps)",
    "scheduler.params.total_num_steps": "the number of training steps (TrainingArguments.max_steps)",
    "fp16.enabled": "TrainingArguments.fp16 (true or false)",
    "bf16.enabled": "TrainingArguments.bf16 (true or false)",
}


def _at(d: Mapping, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return None
        d = d[part]
    return d


def trainer_autos(raw: Mapping) -> list[str]:
    """The keys of `raw` (a DeepSpeed-style dict) whose "auto" only Hugging Face's
    Trainer can fill in, in TRAINER_FILLS' order. A micro batch of "auto" is one of
    them only where train_batch_size is absent or "auto" too (nothing to derive it from)."""
    found = [key for key in TRAINER_FILLS if _at(raw, key) == "auto"]
    if "train_micro_batch_size_per_gpu" in found and raw.get("train_batch_size") not in (None, "auto"):
        found.remove("train_micro_batch_size_per_gpu")  # derived from it, or its own error names it
    return found


def autos_message(keys: list[str]) -> str:
    """One error naming each of `keys` with what stands for it (Note [Hugging Face autos])."""
    lines = [f"  {key}: {TRAINER_FILLS[key]}" for key in keys]
    return (f"{len(keys)} config value{'s are' if len(keys) > 1 else ' is'} 'auto', which Hugging Face's "
            "Trainer fills in from its TrainingArguments before DeepSpeed reads the config; offload reads "
            "the config as written and cannot derive them from the model. Give each a value; the Trainer "
            "would put there:\n" + "\n".join(lines))
