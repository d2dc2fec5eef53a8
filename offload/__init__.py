"""offload: train PyTorch models larger than the GPU, and larger than RAM.

    engine = offload.initialize(model, config)   # an Engine, always (also offload.engine.initialize)
    import offload.deepspeed as deepspeed        # DeepSpeed's surface: its initialize, its 4-tuple
    with offload.init(config): model = Big()      # built straight into its home tiers
    loss = loss_fn(engine(inputs)); engine.backward(loss); engine.step()

Parts: the engine (offload.engine), the partitioned parameter manager
(offload.partition), the fused CPU Adam (offload.ops, offload.optim), async
NVMe I/O (offload.aio), the DeepSpeed-compatible config (offload.config),
DeepSpeed's calling conventions (offload.deepspeed) and the `offload` CLI.
See docs/ARCHITECTURE.md.
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
}

# DeepSpeed's module functions live in its surface, offload.deepspeed: a script
# that imported offload as deepspeed is told where.
_DEEPSPEED_NAMES = frozenset({"add_config_arguments", "init_distributed", "zero", "DeepSpeedEngine"})


def __getattr__(name):
    # Imported on first use so `import offload` (and `offload report`) stays light.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name == "deepspeed":  # the DeepSpeed surface, a subpackage: offload.deepspeed.initialize(...)
        import importlib

        return importlib.import_module("offload.deepspeed")
    if name in _DEEPSPEED_NAMES:
        raise AttributeError(f"offload.{name} is DeepSpeed's: it is offload.deepspeed.{name} "
                             "(`import offload.deepspeed as deepspeed`, not `import offload as deepspeed`)")
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


__all__ = ["initialize", "init", "Engine", "Config", "estimate", "checkpoint", "consolidate", "gathered",
           "ConfigError", "CheckpointError", "WeightsError", "EngineClosedError", "TierBudgetError",
           "SwapStoreError", "AioError", "CorruptFileError", "__version__"]
