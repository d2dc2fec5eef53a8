"""One rank of a two-rank gloo training that must exit 0 (tests/engine/test_lifecycle.py).

Launched by torchrun (`python -m torch.distributed.run --nproc_per_node 2 -m
tests.engine.two_rank_train ROOT`: rank and rendezvous from the
environment) or by multiprocessing spawn (`spawn_main`). Trains the tiny GPT
with parameters and optimizer state on NVMe, checks that close() let go of
the process group and that the engine dies with its last reference (no
cycle left for the garbage collector to find at exit), then ends as a user's
script does: destroy_process_group() and return."""
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist


def train(root: str) -> None:
    import offload
    from tests.support.harness import batches, build, make_config, train_engine

    torch.set_num_threads(1)
    rank = dist.get_rank()
    world_group = dist.group.WORLD
    refs_before = sys.getrefcount(world_group)
    engine = offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", root))
    train_engine(engine, batches(2, world=2), rank=rank)
    engine.close()
    assert sys.getrefcount(world_group) == refs_before, "the closed engine still holds the process group"
    alive = weakref.ref(engine)
    gc.disable()  # freed by reference counting alone: no cycle through the engine
    try:
        del engine
        assert alive() is None, "the engine outlived its last reference (a reference cycle)"
    finally:
        gc.enable()
    del world_group
    dist.destroy_process_group()


def spawn_main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train(root)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train(sys.argv[1])
