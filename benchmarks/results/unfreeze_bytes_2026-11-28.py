import json, torch, transformers, offload, os
os.environ["OFFLOAD_DEVICE"] = "cpu"
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg)
frozen = [n for n, _ in model.named_parameters() if n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))]
for n, p in model.named_parameters():
    p.requires_grad_(n not in frozen)
conf = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
ids = torch.randint(0, 32000, (2, 64))
out = {"params": sum(p.numel() for p in model.parameters()), "frozen_params": sum(model.get_parameter(n).numel() for n in frozen)}
with offload.initialize(model, conf) as engine:
    for i in range(4):
        if i == 2:
            out["before"] = {t: engine.memory_report()[t]["now"] for t in ("device", "host", "nvme")}
            for n in frozen: model.get_parameter(n).requires_grad_(True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); engine.optimizer.step(); engine.optimizer.zero_grad()
    out["after"] = {t: engine.memory_report()[t]["now"] for t in ("device", "host", "nvme")}
print(json.dumps(out))
