"""The compute of a Llama LoRA step without its transfers, measured apart: one decoder
layer of the same shape, built in RAM as the engine's is (bf16; its Linear weights
quantized by the config's `frozen.quantize`, through the same bitsandbytes layers), a
LoRA on q_proj and v_proj, forward and backward at the step's batch x sequence, timed
and multiplied by the number of layers; the output layer and loss timed once.

    python -m offload_bench.compute_probe '{"shape": {...}, "frozen": {...}, "batch": 1, "seq": 16}'

Its own process, so its memory and threads are not the engine's.
"""
from __future__ import annotations

import json
import statistics
import sys
import time


def probe(shape: dict, frozen: dict | None, batch: int, seq: int, repeats: int = 3) -> dict:
    import peft
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from offload.config import Config
    from offload.partition.quantized import quantized_linear, to_quantize
    from offload_bench.lora import LORA

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    if frozen and frozen.get("quantize"):
        fc = Config.load({"frozen": frozen}).frozen
        for name, linear in to_quantize(layer, fc):
            owner, _, local = name.rpartition(".")
            setattr(layer.get_submodule(owner) if owner else layer, local, quantized_linear(linear, fc, "cpu"))
    layer = peft.get_peft_model(torch.nn.Sequential(layer), peft.LoraConfig(**LORA)).train()
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(batch, seq, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    position = rotary(x, torch.arange(seq).unsqueeze(0))
    head = torch.randn(config.vocab_size, config.hidden_size, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (batch * seq,))

    def one_layer():
        out = layer.base_model.model[0](x, position_embeddings=position)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    def output_layer():
        h = x.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, head).float().view(-1, head.shape[0]),
                                                 ids)
        loss.backward()

    timed = {}
    for name, fn in (("layer_s", one_layer), ("output_layer_s", output_layer)):
        fn()  # warm
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        timed[name] = round(statistics.median(samples), 4)
    layers = config.num_hidden_layers
    return {**timed, "layers": layers, "threads": torch.get_num_threads(),
            "step_compute_s": round(layers * timed["layer_s"] + timed["output_layer_s"], 3)}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(probe(spec["shape"], spec.get("frozen"), spec["batch"], spec["seq"])))
