"""examples/hf_from_pretrained.py without transformers: --help still works and
says what to install, and a run is one clear line and exit status 2, not a
traceback. (With transformers, tests/integrations/test_hf_example.py runs it.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_from_pretrained.py"


@pytest.fixture
def without_transformers(tmp_path):
    # Whether or not transformers is installed here: a package of that name
    # first on the path that fails to import, as a missing one does.
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "raise ImportError('No module named transformers (test stand-in)')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(env, cwd, *args):
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def test_help_works_and_names_what_to_install(without_transformers, tmp_path):
    proc = _run(without_transformers, tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "Needs transformers: pip install transformers" in text and 'pip install -e ".[hf]"' in text


@pytest.mark.slow
def test_run_without_transformers_is_one_line_and_exit_2(without_transformers, tmp_path):
    proc = _run(without_transformers, tmp_path, "--steps", "1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "hf_from_pretrained.py: needs transformers, which is not importable (No module named transformers "
        "(test stand-in)); pip install transformers (or pip install -e \".[hf]\" from a checkout)"]
    assert proc.stdout == ""
