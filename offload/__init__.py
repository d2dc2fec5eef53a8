"""offload: train PyTorch models larger than the GPU, and larger than RAM.

    engine = offload.initialize(model, config)   # also offload.engine.initialize
    engine, optimizer, loader, sched = offload.initialize(model=model, config=config, ...)  # DeepSpeed's form
    with offload.init(config): model = Big()      # built straight into its home tiers
    loss = loss_fn(engine(inputs)); engine.backward(loss); engine.step()

Parts: the engine (offload.engine), the partitioned parameter manager
(offload.partition), the fused CPU Adam (offload.ops, offload.optim), async
NVMe I/O (offload.aio), the DeepSpeed-compatible config (offload.config) and
the `offload` CLI. See docs/ARCHITECTURE.md.
"""
__version__ = "0.1.0"

_LAZY = {
    "initialize": ("offload.engine", "initialize"),
    "init": ("offload.engine.init_context", "init"),
    "Engine": ("offload.engine", "Engine"),
    "Config": ("offload.config", "Config"),
    "estimate": ("offload.sizing", "estimate"),
    "checkpoint": ("offload.activations", "checkpoint"),
    "consolidate": ("offload.checkpoint_io", "consolidate"),
    "gathered": ("offload.partition.managed", "gathered"),
    # What the engine raises, each importable from here (`except offload.TierBudgetError`).
    "ConfigError": ("offload.config", "ConfigError"),
    "CheckpointError": ("offload.checkpoint_io", "CheckpointError"),
    "WeightsError": ("offload.engine.weights", "WeightsError"),
    "EngineClosedError": ("offload.engine.closed", "EngineClosedError"),
    "TierBudgetError": ("offload.accounting", "TierBudgetError"),
    "SwapStoreError": ("offload.aio.errors", "SwapStoreError"),
    "AioError": ("offload.aio.errors", "AioError"),
    "CorruptFileError": ("offload.aio.errors", "CorruptFileError"),
    # DeepSpeed's names, so `import offload as deepspeed` runs its scripts (offload/engine/deepspeed_api.py)
    "add_config_arguments": ("offload.engine.deepspeed_api", "add_config_arguments"),
    "init_distributed": ("offload.engine.deepspeed_api", "init_distributed"),
}


def __getattr__(name):
    # Imported on first use so `import offload` (and `offload report`) stays light.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


__all__ = ["initialize", "init", "Engine", "Config", "estimate", "checkpoint", "consolidate", "gathered",
           "ConfigError", "CheckpointError", "WeightsError", "EngineClosedError", "TierBudgetError",
           "SwapStoreError", "AioError", "CorruptFileError",
           "add_config_arguments", "init_distributed", "__version__"]
