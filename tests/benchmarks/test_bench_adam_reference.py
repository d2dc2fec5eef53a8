"""`offload bench adam-reference`: the host update against torch's AdamW element by element
(Note [which AdamW the host update equals]). On the CPU it must find torch's single-tensor
AdamW equal in every element; the ulp measure is checked on known pairs."""
import json
import subprocess
import sys

import torch

from offload_bench.adam_reference import _ulps, compare


def test_ulps_count_fp32_steps_across_zero():
    one = torch.tensor([1.0])
    assert int(_ulps(one, torch.nextafter(one, torch.tensor([2.0])))) == 1
    assert int(_ulps(torch.tensor([-0.0]), torch.tensor([0.0]))) == 0
    tiny = torch.tensor([1e-45])  # the smallest subnormal
    assert int(_ulps(-tiny, tiny)) == 2
    assert int(_ulps(torch.tensor([2.0]), torch.tensor([1.0]))) == 2 ** 23


def test_on_the_cpu_the_host_update_equals_torchs_adamw_in_every_element():
    result = compare("cpu", 100_003, 3, seed=1)
    single = result["worst_step"]["single"]
    assert all(v == {"share": 0.0, "max_ulps": 0, "rel_error": 0.0} for v in single.values()), single
    assert set(result["worst_step"]) <= {"single", "foreach", "fused"}


def test_the_command_writes_its_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "offload", "bench", "adam-reference", "--size", "4096", "--steps", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    written = json.loads((tmp_path / "adam_reference.json").read_text())
    assert written["worst_step"]["single"]["param"] == {"share": 0.0, "max_ulps": 0, "rel_error": 0.0}
    refused = subprocess.run([sys.executable, "-m", "offload", "bench", "adam-reference", "--device", "cuda",
                              "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == (0 if torch.cuda.is_available() else 2)
