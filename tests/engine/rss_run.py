"""One measured training run in a fresh process, for tests/engine/test_memory.py.

    python -m tests.engine.rss_run '{"param": "nvme", "optim": "nvme", "layers": 8,
                                     "width": 2048, "batch": 32, "steps": 2, "nvme_path": "..."}'

prints one JSON line: the RSS baseline taken after the imports, the RSS and
the engine's memory_report after initialize and after each step, the peak
RSS of initialize and of the training steps (VmHWM, reset in between), and
the swap stores' staging budgets. A fresh process, because RSS is a property
of the whole process: what earlier tests allocated, imported or left in
malloc's heaps would be counted.
"""
import json
import sys

import torch

import offload
from offload import process_memory as memory
# What the engine imports on first use (Note [engine bytes and the OS]), so
# that the baseline below is taken after it, as the engine's own is.
import offload.aio.swap_store  # noqa: F401,E402
import offload.transfers.nvme_home  # noqa: F401,E402
import offload.schedulers  # noqa: F401,E402
import torch._dynamo  # noqa: F401,E402
from tests.support.harness import make_config
from tests.support.models import Wide


def _os(report: dict) -> dict:
    return {"host": report["host"], "device": report["device"], "os": report["os"]}


def main(spec: dict) -> dict:
    torch.set_num_threads(1)
    baseline = memory.rss_bytes()
    torch.manual_seed(0)
    model = Wide(spec["layers"], spec["width"])
    model_bytes = memory.parameter_storage_bytes(model)
    after_build = memory.rss_bytes()
    cfg = make_config(spec["param"], spec["optim"], spec["nvme_path"])
    engine = offload.initialize(model, cfg)
    out = {"baseline": baseline, "model_bytes": model_bytes, "after_build": after_build,
           "init": _os(engine.memory_report()), "init_peak": memory.peak_rss_bytes(),
           "peak_reset": memory.reset_peak_rss(), "steps": []}
    out["staging_bytes"] = sum(s.config.buffer_bytes for s in engine._stores)
    gen = torch.Generator().manual_seed(1)
    for _ in range(spec["steps"]):
        x = torch.randn(spec["batch"], spec["width"], generator=gen)
        engine.backward(engine(x))
        engine.step()
        out["steps"].append(_os(engine.memory_report()))
    out["train_peak"] = memory.peak_rss_bytes()
    engine.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
