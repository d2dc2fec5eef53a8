"""`offload bench train`: rounds in rotation, the figures it derives from them, and
--device (cpu, cuda refused without CUDA, sim with the hidden share of transfers)."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.device import overlap
from offload_bench import train, train_contenders

ROOT = Path(__file__).resolve().parents[1]


def _round(median, peak, load=0.0):
    return {"name": "x", "median_s": median, "tokens_per_s": 512 / median, "tflops": 1.0 / median,
            "peak_rss_bytes": peak, "step_times_s": [median], "other_load_share": load, "wall_s": 1.0}


def test_rounds_merge_to_the_median_of_round_medians_and_the_highest_peak():
    merged = train._merge_rounds([_round(2.0, 10), _round(1.0, 30), _round(4.0, 20, load=0.2)])
    assert merged["median_s"] == 2.0
    assert merged["peak_rss_bytes"] == 30
    assert merged["tokens_per_s"] == pytest.approx(512 / 2.0, rel=1e-3)
    assert merged["tflops"] == pytest.approx(1.0 / 2.0, rel=1e-3)
    assert merged["step_times_s"] == [2.0, 1.0, 4.0]
    assert merged["other_load_share"] == 0.2
    assert [r["median_s"] for r in merged["rounds"]] == [2.0, 1.0, 4.0]


def test_a_failed_round_is_the_contenders_result():
    failed = {"name": "x", "error": "exit status 1"}
    assert train._merge_rounds([_round(1.0, 10), failed]) is failed
    assert train._merge_rounds([_round(1.0, 10)]) == _round(1.0, 10)


@pytest.mark.slow
def test_two_quick_rounds_in_rotation_and_the_same_losses_as_torch(tmp_path, capsys):
    out = tmp_path / "out"
    rc = train.main(["--quick", "--rounds", "2", "--contenders", "torch,offload-cpu", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "train.json").read_text())
    assert report["settings"]["rounds"] == 2
    for name in ("torch", "offload-cpu"):
        r = report["results"][name]
        assert len(r["rounds"]) == 2
        assert r["median_s"] == pytest.approx(statistics.median(x["median_s"] for x in r["rounds"]), abs=1e-4)
        assert r["peak_rss_bytes"] == max(x["peak_rss_bytes"] for x in r["rounds"])
    # Same seeded model and batches: the engine's losses are plain torch's.
    assert report["results"]["offload-cpu"]["losses"] == pytest.approx(report["results"]["torch"]["losses"],
                                                                     abs=1e-4)


def test_rounds_below_one_are_refused_before_anything_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where --out (bench_out) and the NVMe directory would go
    assert train.main(["--quick", "--rounds", "0", "--contenders", "torch"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_1b_model_is_the_gpu_measurements_shape():
    from offload_bench.gpt import GPT, GPTConfig

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(GPTConfig(**train.MODELS["1b"])).parameters())
    assert 0.9e9 < params < 1.0e9, params  # 0.94B: hidden 2048, 16 layers, vocab 32000


def test_a_deadline_too_short_skips_every_contender_and_still_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert train.main(["--quick", "--contenders", "torch,offload-cpu", "--deadline", "5",
                       "--out", str(out)]) == 1  # nothing measured
    results = json.loads((out / "train.json").read_text())["results"]
    for name in ("torch", "offload-cpu"):
        assert results[name]["skipped"] and "left of --deadline 5" in results[name]["error"], results[name]
    assert train.main(["--quick", "--contenders", "torch", "--deadline", "-1"]) == 2


def test_a_contender_that_goes_quiet_is_stopped_at_its_limit(tmp_path, monkeypatch):
    """The limit holds for a child that prints nothing (was: checked only per line)."""
    monkeypatch.setattr(train.sys, "executable", str(tmp_path / "quiet.sh"))
    (tmp_path / "quiet.sh").write_text("#!/bin/sh\nsleep 60\n")
    (tmp_path / "quiet.sh").chmod(0o755)
    import time
    start = time.monotonic()
    r = train._run_one("torch", {"device": "cpu"}, 2, tmp_path)
    assert time.monotonic() - start < 20
    assert r["error"] == "timed out after 2 s", r


def test_rounds_merge_to_the_highest_peak_gpu_memory():
    rounds = [{**_round(1.0, 10), "peak_gpu_bytes": 5}, {**_round(2.0, 10), "peak_gpu_bytes": 7}]
    assert train._merge_rounds(rounds)["peak_gpu_bytes"] == 7


def test_tflops_are_six_flops_per_parameter_and_token():
    assert train_contenders.model_tflops(params=10**9, tokens_per_step=1000, step_s=2.0) == 3.0


def test_the_figures_line_names_peak_gpu_memory_only_where_cuda_was_used():
    r = {"median_s": 0.5, "tokens_per_s": 1024.0, "tflops": 0.25, "peak_rss_bytes": 2**30}
    assert train._figures_line(r) == "0.500 s/step, 1024 tokens/s, 0.25 TFLOPS, peak RSS 1.00 GiB"
    assert train._figures_line({**r, "peak_gpu_bytes": 3 * 2**30}).endswith(", peak GPU 3.00 GiB")


# -- --device ------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_device_cuda_without_cuda_is_refused_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where --out (bench_out) and the NVMe directory would go
    assert train.main(["--device", "cuda"]) == 2
    assert f"--device cuda: CUDA is not available here (torch {torch.__version__}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_the_cli_refuses_device_cuda_without_a_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "offload", "bench", "train", "--device", "cuda"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--device cuda: CUDA is not available here" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--sim-gbps", "10"], r"--sim-gbps applies to --device sim only \(got --device cpu\)"),
    (["--device", "sim", "--sim-gbps", "0"], r"--sim-gbps must be a bandwidth > 0 GB/s, got 0.0"),
    (["--device", "sim", "--contenders", "offload-nvme,deepspeed-nvme,fsdp2-cpu"],
     r"--device sim runs ours on the simulated device; deepspeed-nvme, fsdp2-cpu do\(es\) not go through it"),
])
def test_device_options_that_cannot_run_are_refused_before_anything_is_made(tmp_path, monkeypatch, capsys,
                                                                             argv, message):
    monkeypatch.chdir(tmp_path)
    assert train.main(argv) == 2
    assert __import__("re").search(message, capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_each_device_has_its_default_contenders():
    assert train.DEVICE_CONTENDERS["cpu"] == train.DEFAULT_CONTENDERS  # --device cpu: as before
    assert "fsdp2-cpu" in train.DEVICE_CONTENDERS["cuda"]
    assert set(train.DEVICE_CONTENDERS["sim"]) <= set(train.SIM_CONTENDERS)


@pytest.mark.slow  # two contender processes, FSDP2's setup: ~10 s
def test_fsdp2_with_cpu_offload_runs_on_cpu_with_the_same_losses_as_torch(tmp_path):
    out = tmp_path / "out"
    assert train.main(["--quick", "--warmup", "0", "--steps", "2", "--contenders", "torch,fsdp2-cpu",
                       "--out", str(out)]) == 0
    report = json.loads((out / "train.json").read_text())
    torch_run, fsdp2 = report["results"]["torch"], report["results"]["fsdp2-cpu"]
    assert fsdp2["losses"] == pytest.approx(torch_run["losses"], abs=1e-5)
    tokens = report["settings"]["batch"] * report["settings"]["seq"]
    assert fsdp2["tflops"] == pytest.approx(6 * fsdp2["params"] * tokens / fsdp2["median_s"] / 1e12, rel=1e-2)
    assert "peak_gpu_bytes" not in fsdp2  # no CUDA here
    assert report["device"] == "cpu"


def test_device_sim_reports_how_much_transfer_time_was_hidden(tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main(["--quick", "--warmup", "1", "--steps", "2", "--device", "sim", "--sim-gbps", "5",
                       "--contenders", "offload-nvme", "--out", str(out)]) == 0
    report = json.loads((out / "train.json").read_text())
    assert report["device"] == "sim" and report["sim_gbps"] == 5.0
    sim = report["results"]["offload-nvme"]["sim"]
    assert sim["layer"].startswith("sim (seed 0, 5 GB/s")
    copies = sim["host_device"]
    assert copies["copies"] > 0 and {c["stream"] for c in copies["timeline"]} >= {"h2d", "d2h"}
    assert copies["bytes"] == sum(c["bytes"] for c in copies["timeline"])
    # The busy time is the union of the copies drawn, within the step.
    drawn = [(c["start_s"], copies["step_s"] if c["end_s"] is None else c["end_s"]) for c in copies["timeline"]]
    assert copies["busy_s"] == pytest.approx(overlap.length(overlap.intersect(drawn, [(0, copies["step_s"])])))
    for figures in (copies, sim["nvme_reads"]):
        assert 0.0 <= figures["exposed_s"] <= figures["busy_s"]
        assert figures["hidden_fraction"] == pytest.approx(1 - figures["exposed_s"] / figures["busy_s"])
    assert sim["nvme_reads"]["reads"] > 0
    assert copies["exposed_s"] <= copies["compute_blocked_s"] <= copies["step_s"]
    assert all(0 <= start < end <= copies["step_s"] for start, end in copies["compute_blocked"])
    err = capsys.readouterr().err
    # One hidden fraction per timed step; the last one's figures in full.
    assert [step["host_device"] for step in sim["per_step"]][-1] == copies["hidden_fraction"]
    assert len(sim["per_step"]) == 2
    assert sim["median_hidden_fraction"]["nvme_reads"] == pytest.approx(
        statistics.median(step["nvme_reads"] for step in sim["per_step"]))
    assert "offload-nvme host<->device copies at 5 GB/s: " in err
    assert "offload-nvme NVMe reads: " in err
