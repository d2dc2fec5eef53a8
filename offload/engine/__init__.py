"""offload.engine: `initialize(model, config) -> Engine` (also offload.initialize)."""
from offload.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
