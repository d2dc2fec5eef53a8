"""examples/finetune.py end to end (tiny settings), and the stdlib corpus it trains on."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.data import BatchSampler, StdlibSourcesNotFound, load_corpus, split_corpus, stdlib_files

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune.py"
TINY = ["--steps", "8", "--hidden", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--lr", "1e-2", "--corpus-bytes", "200000", "--eval-batches", "1",
        "--no-progress"]


def run_example(*args, timeout=120, path_first=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path_first, str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
def test_finetune_runs_and_cleans_up(offload, tmp_path):
    nvme = tmp_path / "swap" / "nvme"
    proc = run_example(*TINY, "--offload", offload, "--nvme-path", str(nvme))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["offload"] == offload
    assert summary["tokens_per_s"] > 0
    assert summary["last_loss"] < summary["first_loss"]
    assert set(summary["peak_mib"]) == {"device", "host", "nvme"}
    assert summary["peak_rss_mib"] > 0
    if offload == "nvme":
        assert summary["peak_mib"]["nvme"] > 0
    else:
        assert summary["peak_mib"]["nvme"] == 0 and summary["peak_mib"]["host"] > 0
    assert not (tmp_path / "swap").exists()  # swap files and the directories the run made are gone


def test_finetune_existing_nvme_dir_is_kept_but_emptied(tmp_path):
    proc = run_example(*TINY, "--nvme-path", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []


def test_finetune_hf_without_transformers_is_a_clear_error(tmp_path):
    # Whether or not transformers is installed here: a package of that name
    # first on the path that fails to import, as a missing one does.
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "raise ImportError('No module named transformers (test stand-in)')\n")
    proc = run_example(*TINY, "--model", "hf", "--offload", "cpu", path_first=str(tmp_path))
    assert proc.returncode != 0
    assert "pip install transformers" in proc.stderr


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


def test_finetune_ctrl_c_removes_swap_files(tmp_path):
    import signal
    import time

    nvme = tmp_path / "swap" / "nvme"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT prints every thread's stack
    args = [a if a != "8" else "100000" for a in TINY]  # --steps 100000: runs until interrupted
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args, "--nvme-path", str(nvme)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:  # the run prints this once the engine is up and training starts
            if line.startswith("step 0: val loss"):
                break
        else:
            pytest.fail(f"the example ended before training: {proc.wait()}")
        assert any((nvme / "rank0").glob("*.swp"))
        time.sleep(0.5)  # inside the training loop
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            err = proc.communicate(timeout=30)[1]
            pytest.fail(f"the example still ran 60 s after Ctrl-C; its stderr and threads:\n{err[-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not (tmp_path / "swap").exists()
