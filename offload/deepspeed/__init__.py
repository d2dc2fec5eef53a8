"""DeepSpeed's surface over the engine: a script written for DeepSpeed runs with
only its import changed (`import offload.deepspeed as deepspeed`).

    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)

`initialize` here is DeepSpeed's (its keywords, its 4-tuple); `model_engine` is a
DeepSpeedEngine, an adapter around offload's Engine that adds DeepSpeed's
methods the Engine has no concept of (batch sizes, ranks, dtypes, the 16-bit
save). `add_config_arguments` and `init_distributed` are DeepSpeed's module
functions. What is honoured and what is refused, with the reasons:
docs/CONFIG.md, "DeepSpeed drop-in".
"""
from offload.deepspeed.api import add_config_arguments, init_distributed, initialize
from offload.deepspeed.engine import DeepSpeedEngine

__all__ = ["initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine"]
