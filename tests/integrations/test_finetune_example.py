"""examples/finetune.py end to end (tiny settings), and the stdlib corpus it trains on."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from offload_bench.corpus import BatchSampler, StdlibSourcesNotFound, load_corpus, split_corpus, stdlib_files

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "finetune.py"
TINY = ["--steps", "8", "--hidden", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--lr", "1e-2", "--corpus-bytes", "200000", "--eval-batches", "1",
        "--no-progress"]


def run_example(*args, cwd, timeout=120, path_first=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path_first, str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


def places(d: Path) -> list[str]:
    """Every path the example writes, under `d` (so nothing lands in the checkout)."""
    return ["--nvme-path", str(d / "nvme"), "--ckpt-dir", str(d / "ckpt"),
            "--out", str(d / "out" / "model.safetensors")]


def assert_same_weights(path, expected) -> None:
    """Element by element, exactly (the files' metadata names their checkpoint, so may differ)."""
    a, b = load_file(path), load_file(expected)
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("offload", [pytest.param("nvme", marks=pytest.mark.slow), "cpu",
                                     pytest.param("auto", marks=pytest.mark.slow)])
def test_finetune_runs_and_cleans_up(offload, tmp_path):
    nvme = tmp_path / "swap" / "nvme"
    proc = run_example(*TINY, *places(tmp_path), "--offload", offload, "--nvme-path", str(nvme), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = last_json(proc)
    assert summary["offload"] == offload
    assert summary["tokens_per_s"] > 0
    assert summary["last_loss"] < summary["first_loss"]
    assert set(summary["peak_mib"]) == {"device", "host", "nvme"}
    assert summary["peak_rss_mib"] > 0
    if offload == "nvme":
        assert summary["peak_mib"]["nvme"] > 0
        assert summary["nvme_mib"]["read"] > 0 and summary["nvme_mib"]["written"] > 0
    else:  # auto: a tiny model, all of it planned in RAM
        assert summary["peak_mib"]["nvme"] == 0 and summary["peak_mib"]["host"] > 0
        assert summary["nvme_mib"] == {"read": 0, "written": 0}
    assert not (tmp_path / "swap").exists()  # swap files and the directories the run made are gone
    # What the run keeps, and the readable lines before the JSON one.
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "summary.json"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["steps"] == 8 and len(on_disk["train_losses"]) == 8
    assert {k: v for k, v in on_disk.items() if k in summary} == summary
    assert "trained 8 of 8 steps" in proc.stdout and str(out / "model.safetensors") in proc.stdout
    assert (tmp_path / "ckpt" / "global_step8").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


@pytest.mark.slow
def test_finetune_existing_nvme_dir_is_kept_but_emptied(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    proc = run_example(*TINY, *places(tmp_path), "--nvme-path", str(swap), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert swap.is_dir() and list(swap.iterdir()) == []


@pytest.mark.slow
def test_finetune_hf_without_transformers_is_a_clear_error(tmp_path):
    # Whether or not transformers is installed here: a package of that name
    # first on the path that fails to import, as a missing one does.
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "raise ImportError('No module named transformers (test stand-in)')\n")
    proc = run_example(*TINY, *places(tmp_path), "--model", "hf", "--offload", "cpu",
                       path_first=str(tmp_path), cwd=tmp_path)
    assert proc.returncode != 0
    assert "pip install transformers" in proc.stderr


# ---- checkpoints, resume and the saved model ------------------------------------
@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """One uninterrupted TINY run (8 steps), a checkpoint every 2 steps, the last 2 kept."""
    d = tmp_path_factory.mktemp("straight")
    proc = run_example(*TINY, *places(d), "--save-every", "2", "--keep-last", "2", cwd=d)
    assert proc.returncode == 0, proc.stderr
    return d


@pytest.mark.slow
def test_finetune_keeps_the_last_checkpoints(straight_run):
    ckpt = straight_run / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step6", "global_step8", "latest"]
    assert (ckpt / "latest").read_text().strip() == "global_step8"


@pytest.mark.slow
def test_finetune_stopped_and_resumed_is_the_uninterrupted_run(straight_run, tmp_path):
    # The same command starts the job (no checkpoint yet) and continues it.
    first = run_example(*TINY, *places(tmp_path), "--resume", "--stop-at", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "no checkpoint" in first.stderr and last_json(first)["steps"] == 4
    second = run_example(*TINY, *places(tmp_path), "--resume", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    resumed = last_json(second)
    assert resumed["resumed_from"] == str(tmp_path / "ckpt" / "global_step4")
    assert (resumed["steps"], resumed["steps_this_run"]) == (8, 4)

    # Bit for bit: the sampler's position, Adam state, LR schedule and weights all carried over.
    straight = json.loads((straight_run / "out" / "summary.json").read_text())
    again = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert again["train_losses"] == straight["train_losses"]
    assert again["val_loss_after"] == straight["val_loss_after"]
    assert_same_weights(tmp_path / "out" / "model.safetensors", straight_run / "out" / "model.safetensors")


@pytest.mark.slow
def test_finetune_resumes_after_ctrl_c_from_a_mid_run_checkpoint(straight_run, tmp_path):
    # What Ctrl-C during step 7 leaves of the straight run: its checkpoint of step 6,
    # saved mid-run (no final evaluation), and `latest` naming it.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(straight_run / "ckpt" / "global_step6", ckpt / "global_step6")
    (ckpt / "latest").write_text("global_step6\n")
    proc = run_example(*TINY, *places(tmp_path), "--resume", "--save-every", "2", "--keep-last", "2",
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    straight = json.loads((straight_run / "out" / "summary.json").read_text())
    again = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert again["train_losses"] == straight["train_losses"]
    assert_same_weights(tmp_path / "out" / "model.safetensors", straight_run / "out" / "model.safetensors")
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step6", "global_step8", "latest"]


@pytest.mark.slow
def test_finetune_weights_load_into_the_plain_model(straight_run):
    from safetensors.torch import load_model

    from offload_bench.gpt import GPT, GPTConfig, lm_loss

    out = straight_run / "out"
    config = GPTConfig(**json.loads((out / "config.json").read_text()))
    torch.manual_seed(0)  # as the example does before building its model
    initial = GPT(config).state_dict()
    model = GPT(config)
    load_model(model, out / "model.safetensors", strict=True)
    for name, value in model.state_dict().items():
        assert value.abs().sum() > 0 and not torch.equal(value, initial[name]), name
    # The plain model's held-out loss is the one the engine measured at the end.
    _, val = split_corpus(load_corpus(200_000), val_fraction=0.05)
    x, y = BatchSampler(val, 4, 32, seed=1).sample()  # evaluate(): seed + 1, one batch (TINY)
    with torch.no_grad():
        loss = lm_loss(model(x), y).item()
    summary = json.loads((out / "summary.json").read_text())
    assert loss == summary["evals"][-1]["val_loss"]


@pytest.mark.slow
def test_finetune_resume_at_the_last_step_says_so(straight_run, tmp_path):
    ckpt = straight_run / "ckpt"
    before = sorted(p.name for p in ckpt.iterdir())
    proc = run_example(*TINY, *places(tmp_path), "--ckpt-dir", str(ckpt), "--resume", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "already at step 8" in proc.stderr and "no steps this run" in proc.stdout
    summary = last_json(proc)
    assert (summary["steps"], summary["steps_this_run"], summary["tokens_per_s"]) == (8, 0, None)
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert_same_weights(tmp_path / "out" / "model.safetensors", straight_run / "out" / "model.safetensors")


@pytest.mark.slow
def test_finetune_resume_with_other_flags_is_refused(straight_run, tmp_path):
    ckpt = straight_run / "ckpt"
    proc = run_example(*TINY, *places(tmp_path), "--ckpt-dir", str(ckpt), "--resume", "--lr", "5e-3",
                       cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    # The engine refuses first, naming the setting (Note [optimizer settings at load]).
    assert "optimizer.params.lr: saved 0.01, configured 0.005" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, swap files gone


@pytest.mark.slow
def test_finetune_without_resume_starts_over(straight_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight_run / "ckpt", ckpt)
    proc = run_example(*TINY, *places(tmp_path), "--steps", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "starting over" in proc.stderr and last_json(proc)["resumed_from"] is None
    # The earlier run's checkpoints went once this run had one of its own.
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step4", "latest"]


# ---- the corpus --------------------------------------------------------------
@pytest.fixture
def fake_stdlib(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "b.py").write_bytes(b"bbbb\n")
    (tmp_path / "a.py").write_bytes(b"aaaa\n")
    (tmp_path / "pkg" / "c.py").write_bytes(b"cccc\n")
    (tmp_path / "notes.txt").write_bytes(b"not python\n")
    (tmp_path / "site-packages" / "x.py").write_bytes(b"third party\n")
    return tmp_path


def test_corpus_files_sorted_and_stdlib_only(fake_stdlib):
    names = [p.relative_to(fake_stdlib).as_posix() for p in stdlib_files(fake_stdlib)]
    assert names == ["a.py", "b.py", "pkg/c.py"]
    data = load_corpus(root=fake_stdlib)
    assert data.dtype == torch.uint8
    assert bytes(data.tolist()) == b"aaaa\nbbbb\ncccc\n"
    assert bytes(load_corpus(7, root=fake_stdlib).tolist()) == b"aaaa\nbb"


def test_corpus_from_this_python_is_deterministic():
    a, b = load_corpus(100_000), load_corpus(100_000)
    assert a.numel() == 100_000 and torch.equal(a, b)


def test_corpus_missing_stdlib_names_the_path(tmp_path):
    missing = tmp_path / "no" / "lib"
    with pytest.raises(StdlibSourcesNotFound, match=str(missing)):
        load_corpus(root=missing)
    (tmp_path / "only.pyc").write_bytes(b"\0")
    with pytest.raises(StdlibSourcesNotFound, match="no \\*.py files"):
        load_corpus(root=tmp_path)


def test_split_sizes():
    data = torch.arange(1000).to(torch.uint8)
    train, val = split_corpus(data, 0.05, blocks=1)
    assert (train.numel(), val.numel()) == (950, 50)
    assert torch.equal(val, data[950:])
    train, val = split_corpus(data, 0.05, blocks=10)  # 5 bytes from the end of each 100
    assert (train.numel(), val.numel()) == (950, 50)
    assert torch.equal(val[:5], data[95:100]) and torch.equal(val[-5:], data[995:])
    assert torch.equal(torch.cat([train, val]).sort().values, data.sort().values)
    with pytest.raises(ValueError):
        split_corpus(data, 0.0)


def test_batches_shift_by_one_and_are_deterministic():
    data = torch.arange(200).to(torch.uint8)
    x, y = BatchSampler(data, 4, 16, seed=3).sample()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))  # consecutive bytes of the corpus
    a, b = BatchSampler(data, 4, 16, seed=3), BatchSampler(data, 4, 16, seed=3)
    for _ in range(3):
        assert all(torch.equal(u, v) for u, v in zip(a.sample(), b.sample()))
    assert not torch.equal(BatchSampler(data, 4, 16, seed=4).sample()[0], x)
    with pytest.raises(ValueError):
        BatchSampler(data[:10], 1, 16)


def wait_for(condition, proc, timeout, what):
    """Polls `condition` until it holds; fails naming `what` if `proc` ends or `timeout` s pass."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the example exited ({proc.returncode}) before {what}:\n{proc.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no sign in {timeout} s that {what}:\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.01)


@pytest.mark.slow
def test_finetune_ctrl_c_removes_swap_files(tmp_path):
    """Ctrl-C once training runs (its first checkpoint committed, so inside the
    loop, in a step or a save): the run stops with 130, says so, leaves `latest`
    naming a complete checkpoint and removes its swap files."""
    import signal

    nvme = tmp_path / "swap" / "nvme"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT prints every thread's stack
    args = [a if a != "8" else "100000" for a in TINY]  # --steps 100000: runs until interrupted
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args, *places(tmp_path), "--nvme-path", str(nvme),
                             "--save-every", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    latest = tmp_path / "ckpt" / "latest"
    try:
        # The event: step 2's checkpoint committed (`latest` written last). Steps
        # 3 (train only) and 4 (train and save) follow, so the signal lands in either.
        wait_for(latest.exists, proc, 120, "a first checkpoint was committed")
        assert any(nvme.glob("offload-*/rank0/*.swp"))
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            err = proc.communicate(timeout=30)[1]
            pytest.fail(f"the example still ran 60 s after Ctrl-C; its stderr and threads:\n{err[-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not (tmp_path / "swap").exists()
    tag = latest.read_text().strip()
    assert tag.startswith("global_step") and (tmp_path / "ckpt" / tag / "manifest.json").is_file()


def test_finetune_with_compiled_blocks_trains_as_it_does_eager(tmp_path):
    """--compile: the config's compile section from the example's own flag; with aot_eager
    (AOTAutograd's graphs, the same kernels) the losses are eager's, bit for bit."""
    runs = {}
    for backend in (None, "aot_eager"):
        d = tmp_path / str(backend)
        d.mkdir()
        proc = run_example(*TINY, *places(d), "--offload", "cpu", *(["--compile", backend] if backend else []),
                           cwd=d, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert ("compiled 1 blocks (aot_eager)" in proc.stderr) is (backend is not None), proc.stderr[-2000:]
        runs[backend] = json.loads((d / "out" / "summary.json").read_text())
    assert runs["aot_eager"]["compile"] == "aot_eager" and runs[None]["compile"] is None
    assert runs["aot_eager"]["train_losses"] == runs[None]["train_losses"]
