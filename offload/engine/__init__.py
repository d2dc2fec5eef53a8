"""offload.engine: `initialize(model, config) -> Engine` (also offload.initialize)."""
from offload.engine.engine import Engine
from offload.engine.entry import initialize

__all__ = ["Engine", "initialize"]
