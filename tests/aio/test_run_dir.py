"""A run owns its swap directory (issue 16; Note [run directories] in
offload/aio/run_dir.py, Note [creating swap files] in offload/aio/swap_store.py):
two jobs on one nvme_path never meet, a dead run's files are removed at the
next start and a live run's never, no exit leaves swap files behind, and no
swap data is written through a symlink."""
import copy
import fcntl
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import offload
import offload.aio as aio
from offload.aio import Backend, SwapStoreError
from offload.aio.run_dir import LOCK, MARKER, RunDirectories, remove_stale
from offload.aio.swap_store import SwapStore
from offload.aio.swap_config import SwapConfig
from tests.support.harness import batches, build, engine_weights, make_config, run_reference, train_engine

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4

# A training job in a fresh interpreter. argv: mode, nvme_path, a folder for
# its event files (<name> appears when the event happened), then per mode:
#   pair <seed> <peer>  trains STEPS steps once <peer>.ready exists, checks its
#                       weights against plain PyTorch; seed 1 then closes, seed 2
#                       trains its last step only after 1 has closed
#   hold                one step, then waits to be signalled or killed
#   exit                one step, then ends without close()
_JOB = r"""
import os, sys, time
import torch
import offload
from tests.support.harness import batches, build, make_config, run_reference, train_engine, engine_weights

mode, nvme, events = sys.argv[1], sys.argv[2], sys.argv[3]

def event(name):
    open(os.path.join(events, name), "w").close()

def wait_for(name):
    while not os.path.exists(os.path.join(events, name)):
        time.sleep(0.02)

if mode == "pair":
    seed, peer = int(sys.argv[4]), sys.argv[5]
    model, data = build("tiny_gpt", seed=seed), batches(STEPS, seed=seed)
    reference, _ = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    engine = offload.initialize(model, make_config("nvme", "nvme", nvme))
    event(f"{seed}.ready")
    wait_for(f"{peer}.ready")
    train_engine(engine, data[:-1])
    if seed == 2:
        wait_for("1.closed")  # the other job's close() must not touch this one's files
    train_engine(engine, data[-1:])
    weights = engine_weights(engine)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    engine.close()
    event(f"{seed}.closed")
    print("equal to its own plain PyTorch run")
else:
    engine = offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", nvme))
    train_engine(engine, batches(1))
    event("ready")
    if mode == "hold":
        while True:
            time.sleep(0.1)
""".replace("STEPS", str(STEPS))


def _start(mode, nvme, events, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", _JOB, mode, str(nvme), str(events), *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended ({proc.returncode}) before {path.name}:\n{proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name} after {seconds} s")
        time.sleep(0.05)


def _run_dirs(nvme: Path) -> list[Path]:
    return sorted(nvme.glob("offload-*"))


def _nothing_left(nvme: Path) -> bool:
    """No swap file, no run directory left: the nvme_path itself is gone where the run made it
    (aio/run_dir.py removes the folders it made, while empty), else empty."""
    return not nvme.exists() or not any(nvme.iterdir())


def _contents(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_two_jobs_on_one_nvme_path_each_train_their_own_model(tmp_path):
    """Before: both used nvme_path/rank0; each ended with the other's weights
    (26 of 26 parameters differed from its own run) and the first close()
    removed the directory under the second."""
    nvme, events = tmp_path / "nvme", tmp_path / "events"
    events.mkdir()
    jobs = [_start("pair", nvme, events, 1, 2), _start("pair", nvme, events, 2, 1)]
    outputs = [job.communicate(timeout=240) for job in jobs]
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, err
        assert "equal to its own plain PyTorch run" in out
    assert _nothing_left(nvme)  # each removed its own directory, nothing else


def test_each_run_has_its_own_locked_directory_of_mode_0700(tmp_path):
    engine = offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", tmp_path))
    try:
        run_dir, = _run_dirs(tmp_path)
        assert run_dir.name.startswith(f"offload-") and f"-{os.getpid()}-" in run_dir.name
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((run_dir / "rank0").stat().st_mode) == 0o700
        swap_files = list((run_dir / "rank0").glob("*.swp"))
        assert swap_files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in swap_files)
        assert json.loads((run_dir / MARKER).read_text())["pid"] == os.getpid()
        fd = os.open(run_dir / LOCK, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held for the run's life
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        engine.close()
    assert not any(tmp_path.iterdir())


def test_offload_init_and_initialize_share_one_run_directory(tmp_path):
    cfg = make_config("nvme", "nvme", tmp_path)
    with offload.init(cfg):
        model = build("tiny_gpt")
    run_dir, = _run_dirs(tmp_path)
    with offload.initialize(model, cfg) as engine:
        train_engine(engine, batches(1))
        assert _run_dirs(tmp_path) == [run_dir]
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_killed_runs_directory_is_removed_at_the_next_start_and_said(tmp_path, caplog):
    """Before: kill -9 left every swap file behind, and every later run too."""
    nvme, events = tmp_path / "nvme", tmp_path / "events"
    events.mkdir()
    job = _start("hold", nvme, events)
    _wait_for(events / "ready", job)
    dead, = _run_dirs(nvme)
    nbytes = sum(p.stat().st_size for p in dead.rglob("*") if p.is_file())
    assert any(dead.glob("rank0/*.swp"))
    job.kill()
    job.wait()
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine = offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", nvme))
    try:
        assert not dead.exists()
        assert f"removed {dead}" in caplog.text and f"pid {job.pid}" in caplog.text
        assert f"{nbytes} bytes" in caplog.text
        assert len(_run_dirs(nvme)) == 1
    finally:
        engine.close()


@pytest.mark.slow
def test_a_live_runs_directory_is_untouched_and_sigterm_removes_it(tmp_path):
    """Before: SIGTERM left every swap file behind (52 for the tiny GPT)."""
    nvme, events = tmp_path / "nvme", tmp_path / "events"
    events.mkdir()
    job = _start("hold", nvme, events)
    try:
        _wait_for(events / "ready", job)
        live, = _run_dirs(nvme)
        before = _contents(live)
        model, data = build("tiny_gpt"), batches(2)
        reference, _ = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
        with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", nvme)) as engine:
            train_engine(engine, data)
            weights = engine_weights(engine)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0)
        assert _run_dirs(nvme) == [live] and _contents(live) == before
        with pytest.raises(SwapStoreError, match=rf"inside {live}.*live run \(pid {job.pid} on .*in use"):
            offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", live / "rank0"))
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        job.kill()
    assert job.returncode == -signal.SIGTERM  # still dies of the signal
    assert _nothing_left(nvme)


@pytest.mark.slow
def test_exit_without_close_leaves_no_swap_files(tmp_path):
    """Before: 52 swap files stayed after the interpreter exited."""
    nvme, events = tmp_path / "nvme", tmp_path / "events"
    events.mkdir()
    job = _start("exit", nvme, events)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert (events / "ready").exists() and _nothing_left(nvme)


@pytest.mark.slow
def test_ctrl_c_reaches_the_user_and_the_exit_removes_the_files(tmp_path):
    nvme, events = tmp_path / "nvme", tmp_path / "events"
    events.mkdir()
    job = _start("hold", nvme, events)
    _wait_for(events / "ready", job)
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    # Python ends an uncaught KeyboardInterrupt by dying of SIGINT, after its exit handlers.
    assert job.returncode == -signal.SIGINT and "KeyboardInterrupt" in err
    assert _nothing_left(nvme)


def test_a_caught_ctrl_c_leaves_the_run_and_its_files_intact(tmp_path):
    """SIGINT is Python's (KeyboardInterrupt): a script that catches it trains
    on, or saves, from the swap files, so they are not removed then."""
    model, data = build("tiny_gpt"), batches(3)
    reference, _ = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    with offload.initialize(copy.deepcopy(model), make_config("nvme", "nvme", tmp_path)) as engine:
        train_engine(engine, data[:1])
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode
        train_engine(engine, data[1:])
        weights = engine_weights(engine)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0)


def test_stale_cleaning_removes_only_dead_marked_runs_of_this_host(tmp_path):
    def fake_run(name, owner, lock=True):
        d = tmp_path / name
        (d / "rank0").mkdir(parents=True)
        (d / "rank0" / "param.0.swp").write_bytes(b"x" * 100)
        if lock:
            (d / LOCK).touch()
        if owner is not None:
            (d / MARKER).write_text(json.dumps(owner))
        return d

    import socket
    dead_pid = _a_dead_pid()
    here = socket.gethostname()
    dead = fake_run("offload-dead", {"pid": dead_pid, "host": here})
    unmarked = fake_run("offload-unmarked", None)
    elsewhere = fake_run("offload-elsewhere", {"pid": dead_pid, "host": here + "-other"})
    alive = fake_run("offload-alive-owner", {"pid": os.getppid(), "host": here})
    other_name = fake_run("not-offload", {"pid": dead_pid, "host": here})
    held = fake_run("offload-held", {"pid": dead_pid, "host": here})
    target = fake_run("target", {"pid": dead_pid, "host": here})
    (tmp_path / "offload-link").symlink_to(target)
    fd = os.open(held / LOCK, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a live run (or a child it forked) holds it
    try:
        removed = remove_stale(tmp_path)
    finally:
        os.close(fd)
    assert removed == [(dead, 100 + len((json.dumps({"pid": dead_pid, "host": here})).encode()))]
    assert not dead.exists()
    for kept in (unmarked, elsewhere, alive, other_name, held, target):
        assert (kept / "rank0" / "param.0.swp").exists(), kept


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_directories_are_never_adopted_or_shared(tmp_path):
    a, b = RunDirectories(), RunDirectories()
    try:
        da, db = a.open(tmp_path), b.open(tmp_path)
        assert da.path != db.path and a.open(tmp_path) is da  # one per nvme_path per owner
        b.remove()
        assert da.path.is_dir() and not db.path.exists()
    finally:
        a.remove()
        b.remove()
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- symlinks


def _victim(tmp_path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    return victim


@pytest.mark.parametrize("atomic", [False, True], ids=["in_place", "atomic"])
def test_a_symlink_planted_at_a_swap_file_name_is_refused(tmp_path, atomic):
    """Before: the swap data went through the link and overwrote its target."""
    victim = _victim(tmp_path)
    with SwapStore(SwapConfig(nvme_path=tmp_path / "nvme", capacity_bytes=1 << 20, buffer_bytes=1 << 16,
                              atomic=atomic)) as store:
        name = store.path_of("x") if not atomic else store._tmp_of("x")
        name.symlink_to(victim)
        with pytest.raises(SwapStoreError, match=rf"swap file {name} is a symbolic link .*refusing"):
            store.swap_out("x", torch.arange(10.0))
        store.swap_out("y", torch.arange(10.0)).wait()  # the store still works
    assert victim.read_bytes() == b"precious\n"


def _backends():
    return [pytest.param(b, id=b.value, marks=[pytest.mark.skip(reason=aio.unavailable_reason(b))]
                         if aio.unavailable_reason(b) else [])
            for b in (Backend.NATIVE, Backend.LIBAIO, Backend.THREADS)]


@pytest.mark.parametrize("backend", _backends())
def test_no_backend_writes_or_reads_through_a_symlink(tmp_path, backend):
    victim = _victim(tmp_path)
    link = tmp_path / "x.swp"
    link.symlink_to(victim)
    with aio.AsyncIO(backend=backend) as io:
        with pytest.raises(OSError, match="symbolic links") as info:
            io.sync_pwrite(aio.aligned_empty(4096).fill_(7), link)
        assert str(link) in str(info.value)
        with pytest.raises(OSError, match="symbolic links"):
            io.sync_pread(torch.empty(4, dtype=torch.uint8), link)
    assert victim.read_bytes() == b"precious\n"


def test_a_symlinked_or_shared_rank_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "rank0").symlink_to(elsewhere)
    with pytest.raises(SwapStoreError, match=r"rank0 is a symbolic link"):
        SwapStore(SwapConfig(nvme_path=tmp_path / "nvme", capacity_bytes=1 << 20, buffer_bytes=1 << 16))
    assert not any(elsewhere.iterdir())
    shared = tmp_path / "shared"
    (shared / "rank0").mkdir(parents=True)
    os.chmod(shared / "rank0", 0o777)
    with pytest.raises(SwapStoreError, match=r"rank0 is writable by other users \(mode 777\)"):
        SwapStore(SwapConfig(nvme_path=shared, capacity_bytes=1 << 20, buffer_bytes=1 << 16))


def test_a_forked_child_never_removes_its_parents_directory(tmp_path):
    """A DataLoader worker (fork) inherits the exit and signal handlers: they act
    only in the process that made the directory."""
    import offload.aio.run_dir as run_dir_module

    run_dirs = RunDirectories()
    try:
        path = run_dirs.open(tmp_path).path
        pid = os.fork()
        if pid == 0:  # the child runs what its exit would run, then leaves at once
            for finalizer in list(run_dir_module._LIVE.values()):
                finalizer()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert path.is_dir() and (path / MARKER).exists()
    finally:
        run_dirs.remove()
    assert not any(tmp_path.iterdir())
