"""DeepSpeed configs as Hugging Face publishes them, for the tests that load and train with them."""

# Hugging Face's DeepSpeed guide, its ZeRO-3 config as published (cpu offload of both).
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# What the Trainer would put in each of them (TrainingArguments' defaults, batch 4, 100 steps).
HF_ZERO3_FILLED = {
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.warmup_num_steps": 0, "fp16.enabled": False, "bf16.enabled": False,
}


def filled(values: dict | None = None) -> dict:
    """HF_ZERO3 with every auto the Trainer fills in given a value: HF_ZERO3_FILLED's,
    then `values` (dotted keys)."""
    import copy

    d = copy.deepcopy(HF_ZERO3)
    for path, value in {**HF_ZERO3_FILLED, **(values or {})}.items():
        *parents, last = path.split(".")
        node = d
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return d
