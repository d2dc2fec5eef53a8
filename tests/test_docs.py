"""The documentation: the site builds strict (mkdocs.yml), and every code block in
the README and docs/ runs. Python blocks run in order, each file's in one namespace
(as a reader follows a guide), after a setup that gives the names a block takes as
the reader's own (their model, batches, a local Hugging Face model, a ds.json);
`/mnt/nvme` stands for a scratch directory. Bash blocks run in a shell, except the
README's install lines between `ci:` markers, which CI itself runs as written."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)

# What each file's blocks take as given (run first, in the same namespace).
SETUP_MODEL = """
import json, torch
from offload_bench.gpt import GPT, GPTConfig, lm_loss
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=256, hidden=64, layers=2, heads=4, max_seq=32))
batches = [(torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))) for _ in range(2)]
loss_fn = lambda logits, targets: lm_loss(logits, targets)
"""
SETUP_HF = """
import torch, transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
_tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)
LlamaForCausalLM(LlamaConfig(**_tiny)).save_pretrained("path/to/llama")
model_dir = "path/to/llama"
"""
SETUP = {
    "README.md": SETUP_MODEL,
    "docs/guide/training.md": SETUP_MODEL + SETUP_HF + """
from safetensors.torch import save_file
save_file(GPT(GPTConfig(vocab_size=256, hidden=256, layers=4, heads=4)).state_dict(), "model.safetensors")
""",
    "docs/guide/checkpoints.md": SETUP_MODEL + """
import offload
engine = offload.initialize(model, {"train_micro_batch_size_per_gpu": 8,
                                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                          "offload_optimizer": {"device": "cpu"}}})
for inputs, targets in batches:
    engine.backward(lm_loss(engine(inputs), targets)); engine.step()
epoch = 1
""",
    "docs/guide/deepspeed.md": SETUP_MODEL + """
import sys
json.dump({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, open("ds.json", "w"))
sys.argv = ["train.py", "--deepspeed", "--deepspeed_config", "ds.json"]
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
trainset = torch.utils.data.TensorDataset(torch.randn(16, 16), torch.randint(0, 4, (16,)))
criterion = torch.nn.CrossEntropyLoss()
ckpt_dir, epoch = "ckpts", 1
""",
    "docs/guide/huggingface.md": SETUP_HF + """
import offload, peft
from peft import LoraConfig
model = AutoModelForCausalLM.from_pretrained(model_dir)
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/mnt/nvme"},
                                "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme"}}}
max_steps = 2
args = transformers.TrainingArguments("trainer", per_device_train_batch_size=2, max_steps=max_steps, report_to=[],
                                      use_cpu=True, save_strategy="no", disable_tqdm=True)
ids = torch.randint(0, 64, (4, 8))
data = [{"input_ids": row, "labels": row} for row in ids]
batches = [{"input_ids": ids[:2], "labels": ids[:2]}]
""",
    "docs/guide/cpu_optimizer.md": """
import torch
master, exp_avg, exp_avg_sq = torch.randn(1000), torch.zeros(1000), torch.zeros(1000)
grad_bf16, p16, t = torch.randn(1000).bfloat16(), torch.empty(1000, dtype=torch.bfloat16), 1
""",
    "docs/CONFIG.md": """
import json
json.dump({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, open("ds.json", "w"))
""",
}


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order; the README's ci: blocks left out."""
    text = path.read_text()
    for name in ("main-job", "test-command", "torch-release-tests"):  # run by .ci/run as written
        text = re.sub(rf"<!-- ci:{name} -->.*?<!-- /ci:{name} -->", "", text, flags=re.S)
    return [(m.group(2), "\n".join(line[len(m.group(1)):] for line in m.group(3).splitlines()))
            for m in FENCE.finditer(text)]


DOCS = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *ROOT.glob("docs/**/*.md")])


def test_every_fenced_block_says_what_it_is():
    """Code (python, bash) runs below; anything else is marked text."""
    for doc in DOCS:
        for lang, _ in blocks(ROOT / doc):
            assert lang in ("python", "bash", "text"), f"{doc}: a ```{lang} block (python, bash or text)"


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if any(lang != "text" for lang, _ in blocks(ROOT / d))])
def test_every_code_block_runs(doc, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    script = [SETUP.get(doc, "")]
    for i, (lang, code) in enumerate(blocks(ROOT / doc)):
        code = code.replace("/mnt/nvme", str(nvme))
        if lang == "python":
            script.append(f"print('--- block {i}', flush=True)\n{code}")
        elif lang == "bash":
            script.append(f"print('--- block {i}', flush=True)\n"
                          f"subprocess.run({code!r}, shell=True, check=True, executable='/bin/bash')")
    program = "import subprocess\n" + "\n".join(script)
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OFFLOAD_DEVICE": "cpu"})
    assert out.returncode == 0, f"{doc}: {out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    ran = re.findall(r"^--- block (\d+)$", out.stdout, re.M)
    assert len(ran) == sum(lang != "text" for lang, _ in blocks(ROOT / doc)) > 0, (doc, ran)


def test_the_docs_site_builds_strict(tmp_path):
    """mkdocs.yml: every page, the API reference from the docstrings, no warning."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "save_checkpoint" in (tmp_path / "site" / "reference" / "index.html").read_text()
