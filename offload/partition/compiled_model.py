"""torch.compile around a whole model this engine manages: warned once (Note
[compiled models]). Compiling its blocks instead is offload/compile/blocks.py.

Note [compiled models]
torch.compile around a model this engine manages traces the engine's own
machinery with it: the module hooks that gather and release, the forward's
TorchFunctionMode (GatherOnUse, whose `id()` lookups dynamo cannot trace)
and the saved-tensor hooks. Each is a graph break, and the state they read
changes every call, so dynamo recompiles until its limit: GPT 3.4M on a CPU
ran its step 4.2x slower compiled than eager, losses unchanged (2-core AMD,
torch 2.13). So the first traced call warns, once per engine, naming
what to do instead: compile the blocks (engine.compile(), offload/compile/blocks.py), or run
the model eager. The check is dynamo's own `is_compiling()`, true only
while it traces, so an eager call costs one constant test.
"""
from __future__ import annotations

import warnings

COMPILED_MODEL_WARNING = (
    "offload: torch.compile is tracing a model this engine manages: its parameter gathers and hooks "
    "break the graph and force recompiles, so the compiled step runs slower than eager (4x measured), "
    "with the same losses. Compile its blocks instead, at their boundaries: engine.compile() (or "
    "engine.compile(modules=['DecoderLayer'])), and call the model uncompiled (drop torch.compile, or pass "
    "compiled_model._orig_mod, the original module, to the training loop).")


def warn_compiled_model(manager) -> None:
    """Note [compiled models]: once per manager. Called only while dynamo traces (so
    `import offload` does not load dynamo for a decorator); warnings.warn is a graph
    break there, run as Python."""
    if not manager.compile_warned:
        manager.compile_warned = True
        warnings.warn(COMPILED_MODEL_WARNING, RuntimeWarning, stacklevel=3)
