"""The `offload` command: report runs in a fresh process and tells the truth."""
import json
import os
import subprocess
import sys

import pytest

from offload import _native, simd


def _run(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "offload", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_report_json_describes_this_install():
    proc = _run("report", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["simd_detected"] == simd.detected_level()
    assert info["simd_used"] == simd.selected_level()
    assert info["native_extension"] == ("loaded" if _native.available() else info["native_extension"])
    assert info["features"]["cpu_adam"] == ("native" if _native.available() else "pure-PyTorch fallback")
    assert info["threads"] >= 1


@pytest.mark.slow
def test_report_text_shows_forced_simd_level():
    proc = _run("report", env_extra={simd.ENV_VAR: "scalar"})
    assert proc.returncode == 0, proc.stderr
    fields = dict(line.split(None, 1) for line in proc.stdout.splitlines() if " " in line)
    assert fields["simd_used"].strip() == "scalar"
    assert fields["simd_detected"].strip() == simd.detected_level()


@pytest.mark.slow
def test_report_survives_a_bad_simd_override():
    proc = _run("report", "--json", env_extra={simd.ENV_VAR: "bogus"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["simd_used"].startswith("error: OFFLOAD_SIMD='bogus'")


@pytest.mark.slow
def test_unknown_subcommand_is_a_usage_error():
    proc = _run("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice: 'frobnicate'" in proc.stderr


@pytest.mark.skipif(not _native.available(), reason="checks the built extension")
def test_native_extension_does_not_link_libtorch():
    """The extension must build and load without torch: no libtorch/libc10 dependency."""
    import offload._C as ext

    proc = subprocess.run(["ldd", ext.__file__], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"ldd unavailable: {proc.stderr.strip()}")
    assert "libtorch" not in proc.stdout and "libc10" not in proc.stdout, proc.stdout


def _stand_in(tmp_path, module):
    """A package named `module`, first on the path, that fails to import as a missing one does."""
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text(
        f"raise ModuleNotFoundError('No module named {module}', name='{module}')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_report_lists_every_runtime_dependency_with_its_version():
    from importlib.metadata import version

    from offload.requirements import RUNTIME

    proc = _run("report", "--json")
    assert proc.returncode == 0, proc.stderr
    deps = json.loads(proc.stdout)["dependencies"]
    assert set(deps) == {r.distribution for r in RUNTIME if r.applies()}
    for name in ("torch", "numpy", "psutil", "safetensors"):
        assert deps[name] == version(name)


@pytest.mark.parametrize("module", ["numpy", "safetensors", "torch"])
@pytest.mark.slow
def test_report_fails_loudly_on_a_missing_dependency(tmp_path, module):
    proc = _run("report", env_extra=_stand_in(tmp_path, module))
    assert proc.returncode == 1, proc.stdout
    assert f"  {module}: ModuleNotFoundError" in proc.stderr
    assert "pip install" in proc.stderr and module in proc.stderr.splitlines()[-1]


def test_other_commands_name_a_missing_dependency_instead_of_a_traceback(tmp_path):
    proc = _run("estimate", "--params", "1M", env_extra=_stand_in(tmp_path, "torch"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "torch: ModuleNotFoundError" in proc.stderr and "pip install" in proc.stderr


def test_setup_declares_exactly_the_runtime_requirements():
    """setup.py's install_requires is the list `offload report` checks (one source)."""
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = runpy.run_path(str(root / "offload" / "requirements.py"))["install_requires"]()
    assert "numpy>=1.22" in listed  # the code calls Tensor.numpy() (checksums, swap headers)
    assert "RUNTIME_REQUIREMENTS = runpy.run_path" in (root / "setup.py").read_text()
    assert "install_requires=RUNTIME_REQUIREMENTS" in (root / "setup.py").read_text()


def test_version_estimate_and_consolidate_answer_what_a_user_types(tmp_path):
    import offload

    proc = _run("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"offload {offload.__version__}")
    # A model's folder, as from_pretrained takes it, for --model-config.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100}))
    folder, file = _run("estimate", "--model-config", str(tmp_path / "model")), \
        _run("estimate", "--model-config", str(tmp_path / "model" / "config.json"))
    assert folder.returncode == 0 and folder.stdout == file.stdout, folder.stderr
    (tmp_path / "empty").mkdir()
    proc = _run("estimate", "--model-config", str(tmp_path / "empty"))
    assert proc.returncode == 2 and "without a config.json" in proc.stderr
    # A plan that does not fit its budgets exits 1, naming what is short; one that fits, 0.
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3},
                                                  "memory": {"device_budget": "1GB"}}))
    short = _run("estimate", "--params", "7B", "--config", str(tmp_path / "ds.json"))
    assert short.returncode == 1 and "does not fit: memory.device_budget" in short.stderr
    assert _run("estimate", "--params", "7M", "--config", str(tmp_path / "ds.json")).returncode == 0
    # consolidate given a file says so.
    (tmp_path / "a-file").write_text("x")
    proc = _run("consolidate", str(tmp_path / "a-file"), str(tmp_path / "out.safetensors"))
    assert proc.returncode != 0 and "is a file, not a checkpoint directory" in proc.stderr


def test_report_says_tested_rather_than_none_for_a_tested_torch():
    from offload.torch_release import torch_release_problem, torch_release_untested

    info = json.loads(_run("report", "--json").stdout)
    want = torch_release_problem() or torch_release_untested() or "tested"
    assert info["torch_release"] == want and info["torch_release"] is not None
