"""`offload bench train`: rounds in rotation, the figures it derives from them,
--device (cpu, cuda refused without CUDA, sim with the hidden share of transfers),
--precision, --model 7b and --layers, the torchao-cpu anchor (skipped without
CUDA or torchao) and each timed step's critical path for ours."""
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.device import hidden_time
from offload_bench import train, train_contenders, train_report, train_timeline

ROOT = Path(__file__).resolve().parents[2]


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
    assert train_report.figures_line(r) == "0.500 s/step, 1024 tokens/s, 0.25 TFLOPS, peak RSS 1.00 GiB"
    assert train_report.figures_line({**r, "peak_gpu_bytes": 3 * 2**30}).endswith(", peak GPU 3.00 GiB")


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
    assert copies["busy_s"] == pytest.approx(hidden_time.length(hidden_time.intersect(drawn, [(0, copies["step_s"])])))
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


# -- --precision, --model 7b, --layers ---------------------------------------------

def _args(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser, parser.parse_args(list(argv))


def test_precision_model_and_layers_default_to_what_the_bench_ran_before():
    _, args = _args()
    assert (args.precision, args.model, args.layers) == ("fp32", "67m", None)
    settings = train._settings(args)
    assert settings["model"] == train.FULL_MODEL and settings["precision"] == "fp32"
    assert (settings["model_name"], settings["layers"], settings["params"]) == ("67m", 4, 67_295_232)
    assert "bf16" not in train.ds_config("cpu", batch=4, lr=1e-4)  # fp32: no section, as before


def test_bf16_is_recorded_in_the_settings_and_in_the_config_ours_and_deepspeed_share():
    _, args = _args("--precision", "bf16", "--quick")
    assert train._settings(args)["precision"] == "bf16"
    for mode in ("cpu", "nvme"):
        cfg = train.ds_config(mode, batch=2, lr=1e-4, nvme_path="/x", largest_param=10, precision="bf16")
        assert cfg["bf16"] == {"enabled": True}
    with pytest.raises(SystemExit):
        _args("--precision", "fp16")


def test_the_7b_model_is_llama2_7bs_width_at_a_depth_a_24_gib_host_holds():
    from offload_bench.gpt import GPT, GPTConfig

    parser, args = _args("--model", "7b")
    settings = train._settings(args)
    model = settings["model"]
    assert (model["hidden"], model["heads"], model["mlp_hidden"], model["vocab_size"]) == (4096, 32, 11008, 32000)
    assert settings["layers"] == 2
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**model))
    assert sum(p.numel() for p in gpt.parameters()) == settings["params"] == 593_597_952
    assert gpt.blocks[0].fc.out_features == 11008
    # fp32 weights, gradients and Adam's two moments: 16 bytes a parameter, with room to spare.
    assert settings["params"] * 16 < 0.5 * 24 * 2**30
    assert f"{settings['params'] / 1e9:.2f}B parameters" in parser.format_help()


def test_layers_overrides_any_models_depth_and_below_one_is_refused(tmp_path, monkeypatch, capsys):
    from offload_bench.gpt import GPTConfig

    for argv, layers in ((["--model", "7b", "--layers", "3"], 3), (["--model", "1b", "--layers", "1"], 1),
                         (["--quick", "--layers", "5"], 5)):
        settings = train._settings(_args(*argv)[1])
        assert settings["layers"] == settings["model"]["layers"] == layers
        assert settings["params"] == GPTConfig(**settings["model"]).num_params()
    one, two = (train._settings(_args("--model", "7b", "--layers", str(n))[1])["params"] for n in (1, 2))
    assert two - one == 157_334_272  # one 7b block: 4 x 4096^2 + 2 x 4096 x 11008, and biases and norms
    monkeypatch.chdir(tmp_path)
    assert train.main(["--quick", "--layers", "0", "--contenders", "torch"]) == 2
    assert "--layers must be at least 1, got 0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two contender processes: ~8 s
def test_a_bf16_run_records_its_precision_and_each_timed_steps_critical_path(tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main(["--quick", "--precision", "bf16", "--layers", "3", "--contenders",
                       "torch,offload-cpu,torchao-cpu", "--out", str(out)]) == 0  # torchao: skipped, not failed
    report = json.loads((out / "train.json").read_text())
    assert report["settings"]["precision"] == "bf16" and report["settings"]["layers"] == 3
    assert report["ds_config"]["cpu"]["bf16"] == {"enabled": True}
    results = report["results"]
    torch_run, ours = results["torch"], results["offload-cpu"]
    assert torch_run["precision"] == ours["precision"] == "bf16"
    assert "torch.autocast('cpu', bf16)" in torch_run["precision_how"]
    assert ours["precision_how"] == 'the config\'s "bf16": {"enabled": true}'
    # bf16 weights (ours) against autocast over fp32 weights (torch): close, not equal.
    assert ours["losses"] == pytest.approx(torch_run["losses"], abs=2e-2)
    assert results["torchao-cpu"]["skipped"] and "needs CUDA" in results["torchao-cpu"]["reason"]
    steps = ours["timeline_per_step"]
    assert len(steps) == report["settings"]["steps"]
    assert [s["step_s"] for s in steps] == pytest.approx(ours["step_times_s"], abs=1e-4)
    for s in steps:
        assert 0 < s["wall_s"] <= s["step_s"]
        assert s["compute_s"] > 0 and s["optimizer_s"] > 0
        assert sum(s["critical_path"].values()) == pytest.approx(s["wall_s"], abs=1e-5)
        assert set(s) <= set(report["timeline_per_step_doc"]) | {"copies_busy_s", "copies_exposed_s"}
    assert "timeline_per_step" not in torch_run
    err = capsys.readouterr().err
    assert "(quick, 3 layers), batch 2 x seq 32, bf16, --device cpu" in err  # the closing table's title
    assert re.search(r"\n   torchao-cpu +skipped: torchao's CPUOffloadOptimizer needs CUDA", err)


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_torchao_cpu_without_cuda_is_skipped_with_its_reason_without_a_process(tmp_path, monkeypatch, device):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "_run_one", lambda *a, **k: pytest.fail("torchao-cpu was started"))
    out = tmp_path / "out"
    assert train.main(["--quick", "--device", device, "--contenders", "torchao-cpu", "--out", str(out)]) == 0
    r = json.loads((out / "train.json").read_text())["results"]["torchao-cpu"]
    assert r["skipped"] and "error" not in r
    assert r["reason"].startswith("torchao's CPUOffloadOptimizer needs CUDA") and f"--device {device}" in r["reason"]


def test_torchao_cpu_where_torchao_does_not_import_is_skipped_in_its_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what an absent package does to an import
    spec = {"settings": train._settings(_args("--quick")[1]), "device": "cuda"}
    r = train_contenders.run_contender("torchao-cpu", spec)
    assert r["skipped"] and r["reason"].startswith("torchao does not import here (ModuleNotFoundError")
    assert "median_s" not in r and "error" not in r


def _span(kind, start, end, thread="compute", name=""):
    return {"kind": kind, "name": name, "start_s": start, "seconds": end - start, "thread": thread}


def test_the_critical_path_splits_the_compute_threads_wall_time_inner_spans_first():
    spans = [_span("forward", 0, 4), _span("wait", 1, 2), _span("read", 0.5, 3, "aio"),
             _span("backward", 4, 8), _span("optimizer", 5, 7, "optimizer-0"), _span("write", 6, 9, "aio"),
             _span("optimizer", 8, 9), _span("wait", 8.5, 9)]
    seconds = {k: 0.0 for k in ("forward", "backward", "read", "write", "optimizer", "wait")}
    for s in spans:
        seconds[s["kind"]] += s["seconds"]
    step = train_timeline.critical_path({"wall_s": 10.0, "seconds": seconds, "spans": spans}, step_s=10.5)
    assert step["critical_path"] == {"compute_s": 7.0, "wait_s": 1.5, "optimizer_s": 0.5, "other_s": 1.0}
    assert (step["compute_s"], step["wait_s"], step["optimizer_s"], step["optimizer_on_compute_s"]) == (8, 1.5, 3, 1)
    assert (step["read_s"], step["reads"], step["write_s"], step["writes"], step["step_s"]) == (2.5, 1, 3, 1, 10.5)


def test_the_waits_are_told_apart_by_where_the_compute_thread_waited():
    spans = [_span("forward", 0, 4), _span("wait", 1, 1.5, name="blocks.0.fc.weight"),
             _span("backward", 4, 8), _span("wait", 5, 5.25, name="blocks.0.fc.weight"),
             _span("wait", 6, 7, name="optimizer backlog"), _span("wait", 3, 3.5, "offload-host", "optimizer state x"),
             _span("wait", 8, 10, name="optimizer")]
    seconds = {k: sum(s["seconds"] for s in spans if s["kind"] == k)
               for k in ("forward", "backward", "read", "write", "optimizer", "wait")}
    step = train_timeline.critical_path({"wall_s": 10.0, "seconds": seconds, "spans": spans})
    assert step["waits"] == {"forward_reads_s": 0.5, "backward_reads_s": 0.25, "backlog_s": 1.0,
                             "after_backward_s": 2.0}
    assert sum(step["waits"].values()) == step["critical_path"]["wait_s"]


def test_rounds_merge_every_rounds_timed_steps_and_their_median_critical_path():
    def steps(*walls):
        return [{"wall_s": w, "critical_path": {"compute_s": w - 1, "wait_s": 0.0, "optimizer_s": 0.5,
                                                "other_s": 0.5}} for w in walls]
    rounds = [{**_round(1.0, 10), "timeline_per_step": steps(3.0, 5.0)},
              {**_round(2.0, 10), "timeline_per_step": steps(4.0)}]
    merged = train._merge_rounds(rounds)
    assert [s["wall_s"] for s in merged["timeline_per_step"]] == [3.0, 5.0, 4.0]
    assert merged["critical_path_median"] == {"wall_s": 4.0, "compute_s": 3.0, "wait_s": 0.0, "optimizer_s": 0.5,
                                              "other_s": 0.5}


def test_compile_adds_each_compiled_twin_once():
    _, args = _args("--contenders", "torch,offload-nvme,offload-nvme-compiled,deepspeed-cpu", "--compile")
    assert train.contender_names(args) == ["torch", "torch-compiled", "offload-nvme", "offload-nvme-compiled",
                                           "deepspeed-cpu"]
    _, args = _args("--contenders", "offload-cpu,offload-cpu")
    assert train.contender_names(args) == ["offload-cpu"]
