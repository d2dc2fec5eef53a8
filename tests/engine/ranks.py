"""Several ranks in spawned processes, for the tests that train with world size 2."""
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, args, *, world=2, timeout=280) -> tuple[dict, list]:
    """Spawns `world` ranks running worker(rank, world, port, *args, results), each
    putting (rank, key, "ok" or a traceback) on results. Returns ({(rank, key): status},
    the processes, joined)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    outcome = {}
    while not results.empty():
        rank, key, status = results.get()
        outcome[(rank, key)] = status
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return outcome, procs
