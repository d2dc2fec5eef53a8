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


def test_report_text_shows_forced_simd_level():
    proc = _run("report", env_extra={simd.ENV_VAR: "scalar"})
    assert proc.returncode == 0, proc.stderr
    fields = dict(line.split(None, 1) for line in proc.stdout.splitlines() if " " in line)
    assert fields["simd_used"].strip() == "scalar"
    assert fields["simd_detected"].strip() == simd.detected_level()


def test_report_survives_a_bad_simd_override():
    proc = _run("report", "--json", env_extra={simd.ENV_VAR: "bogus"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["simd_used"].startswith("error: OFFLOAD_SIMD='bogus'")


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
