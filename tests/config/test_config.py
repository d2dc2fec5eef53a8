"""offload.config: DeepSpeed configs load unchanged; every refusal names its key."""
import copy
import json

import pytest
import torch

from offload.aio.config import Backend
from tests.config.hf_configs import HF_ZERO3, HF_ZERO3_FILLED, filled
from offload.config import (
    AUTO,
    AioConfig,
    Config,
    ConfigError,
    MemoryConfig,
    OffloadParamConfig,
    OptimizerType,
    Precision,
    SchedulerType,
    Tier,
    WarmupType,
    ZeroConfig,
    parse_bytes,
)

# A ZeRO-Infinity config as DeepSpeed's docs and tutorials write them.
DS_ZERO_INFINITY = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                     "warmup_num_steps": 500, "total_num_steps": 10000}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
            "single_submit": False, "overlap_events": True},
}


def with_(path: str, value, base=DS_ZERO_INFINITY):
    """A copy of `base` with the dotted key set (value DELETE removes it)."""
    d = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return d


DELETE = object()


def test_ds_zero_infinity_config_loads_unchanged():
    before = copy.deepcopy(DS_ZERO_INFINITY)
    c = Config.load(DS_ZERO_INFINITY)
    assert DS_ZERO_INFINITY == before  # the input is not mutated
    assert c.precision is Precision.BF16
    assert c.train_micro_batch_size_per_gpu is AUTO
    z = c.zero_optimization
    assert z.offload_param.device is Tier.NVME and str(z.offload_param.nvme_path) == "/local_nvme"
    assert z.offload_param.buffer_size == 100_000_000 and isinstance(z.offload_param.buffer_size, int)
    assert z.sub_group_size == 1_000_000_000 and isinstance(z.sub_group_size, int)
    assert z.reduce_bucket_size is AUTO and z.stage3_prefetch_bucket_size is AUTO
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert c.optimizer.type is OptimizerType.ADAMW and c.optimizer.betas == (0.9, 0.95)
    assert c.scheduler.type is SchedulerType.WARMUP_DECAY_LR
    assert c.scheduler.params.total_num_steps == 10000
    assert c.scheduler.params.warmup_type is WarmupType.LOG
    assert c.aio.queue_depth == 8 and c.aio.backend is Backend.AUTO


def test_defaults():
    c = Config.load({})
    assert c.precision is Precision.FP32
    assert c.gradient_accumulation_steps == 1 and c.gradient_clipping == 0.0
    assert c.optimizer is None and c.scheduler is None
    z = c.zero_optimization
    assert z.stage == 3 and z.offload_param.device is Tier.DEVICE
    assert (z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters, z.stage3_max_reuse_distance,
            z.stage3_param_persistence_threshold, z.sub_group_size, z.reduce_bucket_size) == (
        None, None, None, 100_000, 1_000_000_000, None)
    assert z.offload_param.buffer_count is None and z.offload_param.buffer_size is None
    assert c.aio == AioConfig() and c.aio.block_size == 1 << 20 and c.aio.queue_depth == 32
    assert c.fp16.initial_scale_power == 16 and c.fp16.loss_scale == 0.0 and c.fp16.dynamic
    assert c.memory == MemoryConfig()


def test_round_trip():
    c = Config.load(DS_ZERO_INFINITY)
    d = c.to_dict()
    json.dumps(d)  # plain JSON
    assert Config.from_dict(d) == c
    assert Config.load(Config.load({}).to_dict()) == Config.load({})
    r = c.resolve_auto(4096, 7_000_000_000, world_size=2)
    assert Config.from_dict(r.to_dict()) == r


def test_load_config_returns_it_and_json_path(tmp_path):
    c = Config.load(DS_ZERO_INFINITY)
    assert Config.load(c) is c
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_ZERO_INFINITY))
    assert Config.load(path) == c and Config.load(str(path)) == c


def test_bad_json_file_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"bf16": {"enabled": true},}')
    with pytest.raises(ConfigError, match=r"broken\.json.*invalid JSON at line 1"):
        Config.load(path)
    with pytest.raises(ConfigError, match=r"missing\.json"):
        Config.load(tmp_path / "missing.json")
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"broken\.json.*not a JSON object"):
        Config.load(path)
    path.write_text('{"zero_optimization": {"stage": 2}}')
    with pytest.raises(ConfigError, match=r"broken\.json.*zero_optimization\.stage"):
        Config.load(path)


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"^unknown key 'zero_optimization\.stage3_prefetch_bucket_sz' "
                                          r"\(did you mean 'stage3_prefetch_bucket_size'\?\)$"):
        Config.load(with_("zero_optimization.stage3_prefetch_bucket_sz", 5))
    with pytest.raises(ConfigError, match=r"unknown key 'train_micro_batch_size' \(did you mean "
                                          r"'train_micro_batch_size_per_gpu'\?\)"):
        Config.load({"train_micro_batch_size": 4})
    with pytest.raises(ConfigError, match=r"unknown key 'zzz' \(accepted: train_batch_size, "):
        Config.load({"zzz": 1})
    with pytest.raises(ConfigError, match=r"unknown key 'memory\.host_budgett' \(did you mean 'host_budget'"):
        Config.load({"memory": {"host_budgett": 1}})
    with pytest.raises(ConfigError, match=r"unknown key 'scheduler\.params\.warmup_max' \(did you mean "
                                          r"'warmup_max_lr'"):
        Config.load({"scheduler": {"type": "WarmupLR", "params": {"warmup_max": 1}}})


@pytest.mark.parametrize("path", [
    "fp16.auto_cast", "fp16.consecutive_hysteresis", "optimizer.params.amsgrad",
    "optimizer.params.bias_correction", "amp", "pipeline", "elasticity", "tensor_parallel",
])
def test_refused_deepspeed_keys_name_key_and_reason(path):
    """Ignoring these would change what the user gets: errors saying what to do."""
    with pytest.raises(ConfigError, match=rf"^'{path.replace('.', r'.')}' is a DeepSpeed key offload does "
                                          r"not support: \S"):
        Config.load(with_(path, True))


# Every key of DeepSpeed's ZeRO-3 / ZeRO-Infinity reference (docs/config-json,
# "ZeRO Optimizations", "Parameter offloading", "Optimizer offloading",
# "Asynchronous I/O") that offload does not read, with a typical value.
INERT_DS_KEYS = {
    "zero_optimization.round_robin_gradients": True,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 5e8,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.cpu_offload_use_pin_memory": True,
    "zero_optimization.offload_optimizer.pin_memory": True,  # Note [pin_memory] in sections.py
    "zero_optimization.stage3_model_persistence_threshold": 1e9,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,
    "zero_optimization.zero_quantized_weights": True,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": True,
    "zero_optimization.memory_efficient_linear": True,
    "zero_optimization.override_module_apply": True,
    "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.offload_optimizer.pipeline_read": False,
    "zero_optimization.offload_optimizer.pipeline_write": False,
    "zero_optimization.offload_optimizer.fast_init": False,
    "zero_optimization.offload_optimizer.ratio": 0.3,
    "aio.use_gds": False,
    "bf16.bf16_master_weights_and_grads": True,
    "bf16.immediate_grad_update": True,
    "fp16.fp16_master_weights_and_grads": False,
    "optimizer.params.torch_adam": True,
    "optimizer.params.fused": True,
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "prescale_gradients": False,
    "communication_data_type": "fp32",
    "tensorboard": {"enabled": True, "output_path": "logs/"},
    "wandb": {"enabled": True, "project": "p"},
    "flops_profiler": {"enabled": False},
    "checkpoint": {"tag_validation": "Warn"},
    "data_types": {"grad_accum_dtype": "fp32"},
    "compile.deepcompile": True,
    "compile.offload_activation": True,
    "compile.passes": ["z3"],
}


@pytest.mark.parametrize("path", sorted(INERT_DS_KEYS))
def test_inert_deepspeed_keys_load_and_are_named_with_a_reason(path):
    c = Config.load(with_(path, INERT_DS_KEYS[path]))
    assert c == Config.load(DS_ZERO_INFINITY)  # no effect on any setting
    notes = dict(c.no_effect())
    assert path in notes and len(notes[path]) > 10
    line = c.no_effect_line()
    assert line.startswith("config keys accepted with no effect here") and f"{path}: " in line


def test_all_inert_keys_at_once_give_one_line_naming_each():
    d = copy.deepcopy(DS_ZERO_INFINITY)
    for path, value in INERT_DS_KEYS.items():
        d = with_(path, value, base=d)
    c = Config.load(d)
    assert sorted(k for k, _ in c.no_effect()) == sorted(INERT_DS_KEYS)
    assert c.no_effect_line().count(": ") >= len(INERT_DS_KEYS)
    assert Config.from_dict(c.to_dict()) == c and "inert" not in c.to_dict()


def test_a_config_with_only_honoured_keys_has_no_note():
    d = with_("zero_optimization.offload_param.pin_memory", DELETE)
    d = with_("zero_optimization.offload_optimizer.pin_memory", DELETE, base=d)
    assert Config.load(d).no_effect() == []
    assert Config.load(d).no_effect_line() is None


@pytest.mark.parametrize("path, value, why", [
    ("zero_optimization.contiguous_gradients", False, "false has no effect"),
    ("aio.single_submit", True, "true has no effect"),
    ("aio.overlap_events", False, "false has no effect"),
])
def test_values_offload_does_not_act_on_are_named(path, value, why):
    notes = dict(Config.load(with_(path, value)).no_effect())
    assert notes[path].startswith(why)


def test_sections_given_to_config_directly_name_their_keys_with_no_effect():
    c = Config(aio={"single_submit": True, "use_gds": True},
               zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}})
    assert set(dict(c.no_effect())) == {"aio.single_submit", "aio.use_gds",
                                        "zero_optimization.offload_optimizer.pin_memory"}
    assert Config(aio={"single_submit": False}).no_effect() == []


def test_thread_count_is_mapped_to_intra_op_parallelism():
    d = with_("aio.intra_op_parallelism", DELETE)
    assert Config.load(with_("aio.thread_count", 4, base=d)).aio.intra_op_parallelism == 4
    assert Config.load(with_("aio.thread_count", 1)).aio.intra_op_parallelism == 1  # same value twice: fine
    with pytest.raises(ConfigError, match=r"^'aio\.thread_count' \(4\) and 'aio\.intra_op_parallelism' \(1\) "
                                          r"are one setting under two names"):
        Config.load(with_("aio.thread_count", 4))
    with pytest.raises(ConfigError, match=r"aio\.intra_op_parallelism: 0 is not an integer"):
        Config.load(with_("aio.thread_count", 0, base=d))


@pytest.mark.parametrize("old", ["stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"])
def test_old_gather_names_are_mapped(old):
    d = with_("zero_optimization.stage3_gather_16bit_weights_on_model_save", DELETE)
    c = Config.load(with_(f"zero_optimization.{old}", True, base=d))
    assert c.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_bfloat16_is_mapped_to_bf16():
    d = with_("bf16", DELETE)
    assert Config.load(with_("bfloat16", {"enabled": True}, base=d)).precision is Precision.BF16


@pytest.mark.parametrize("old, section", [("cpu_offload", "offload_optimizer"),
                                          ("cpu_offload_param", "offload_param")])
def test_deprecated_cpu_offload_booleans_are_mapped(old, section):
    d = {"zero_optimization": {"stage": 3, old: True}}
    assert getattr(Config.load(d).zero_optimization, section).device is Tier.HOST
    d = {"zero_optimization": {"stage": 3, old: False}}
    assert getattr(Config.load(d).zero_optimization, section).device is Tier.DEVICE
    d = {"zero_optimization": {"stage": 3, old: True, section: {"device": "cpu", "pin_memory": True}}}
    assert getattr(Config.load(d).zero_optimization, section).device is Tier.HOST
    # Note [pin_memory]: offload_param's decides for parameters; offload_optimizer's is named as inert
    assert (f"zero_optimization.{section}.pin_memory" in dict(Config.load(d).no_effect())) is (
        section == "offload_optimizer")
    with pytest.raises(ConfigError, match=rf"'zero_optimization\.{old}': true .* contradicts "
                                          rf"'zero_optimization\.{section}'"):
        Config.load(with_(f"zero_optimization.{old}", True))  # the base offloads to nvme


def test_a_misspelt_deepspeed_key_is_still_an_error():
    with pytest.raises(ConfigError, match=r"unknown key 'aio\.thread_cout' \(did you mean 'thread_count'"):
        Config.load(with_("aio.thread_cout", 1))
    with pytest.raises(ConfigError, match=r"unknown key 'zero_optimization\.round_robin_gradient' "
                                          r"\(did you mean 'round_robin_gradients'"):
        Config.load(with_("zero_optimization.round_robin_gradient", True))
    with pytest.raises(ConfigError, match=r"unknown key 'inert'"):
        Config.load({"inert": []})


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.max_grad_norm'.*'gradient_clipping'"):
        Config.load(with_("optimizer.params.max_grad_norm", 1.0))


# Note [Hugging Face autos] (offload/config/hf_autos.py): one "auto" the Trainer fills in, named alone
HF_AUTO_ONE = r"^1 config value is 'auto', which Hugging Face's Trainer fills in[^\n]*\n  "


@pytest.mark.parametrize("path, value, message", [
    ("zero_optimization.offload_param.device", "gpu",
     r"^zero_optimization\.offload_param\.device: 'gpu' is not one of none, cpu, nvme, auto$"),
    ("zero_optimization.offload_optimizer.device", "CPU", r"offload_optimizer\.device: 'CPU' is not one of"),
    ("zero_optimization.stage", 2, r"^zero_optimization\.stage: 2 is not 3 \(offload implements ZeRO stage 3"),
    ("zero_optimization.stage", 0, r"zero_optimization\.stage: 0 is not 3"),
    ("zero_optimization.stage", True, r"zero_optimization\.stage: True is not 3"),
    ("zero_optimization.sub_group_size", "1e9", r"zero_optimization\.sub_group_size: '1e9' is not an integer"),
    ("zero_optimization.sub_group_size", 0, r"zero_optimization\.sub_group_size: 0 is not an integer >= 1"),
    ("zero_optimization.stage3_max_live_parameters", 1.5,
     r"zero_optimization\.stage3_max_live_parameters: 1\.5 is not an integer"),
    ("zero_optimization.reduce_bucket_size", True, r"zero_optimization\.reduce_bucket_size: True is not"),
    ("zero_optimization.overlap_comm", 1, r"zero_optimization\.overlap_comm: 1 is not true or false"),
    ("zero_optimization.offload_param.buffer_count", 0,
     r"zero_optimization\.offload_param\.buffer_count: 0 is not an integer >= 1"),
    ("zero_optimization.offload_param.buffer_size", "3", r"offload_param\.buffer_size: '3' is not an integer"),
    ("zero_optimization.offload_param.nvme_path", DELETE,
     r"zero_optimization\.offload_param\.nvme_path: required when zero_optimization\.offload_param\.device "
     r"is 'nvme'"),
    ("zero_optimization.offload_optimizer.nvme_path", DELETE,
     r"zero_optimization\.offload_optimizer\.nvme_path: required when"),
    ("zero_optimization.offload_param", "nvme", r"zero_optimization\.offload_param: 'nvme' is not a JSON object"),
    ("train_batch_size", "64", r"^train_batch_size: '64' is not an integer >= 1"),
    ("train_batch_size", 0, r"^train_batch_size: 0 is not an integer"),
    ("gradient_accumulation_steps", 0, r"^gradient_accumulation_steps: 0 is not an integer >= 1"),
    ("gradient_accumulation_steps", True, r"^gradient_accumulation_steps: True is not an integer"),
    ("gradient_clipping", -1.0, r"^gradient_clipping: -1\.0 is not a number >= 0"),
    ("gradient_clipping", "auto", HF_AUTO_ONE + r"gradient_clipping: TrainingArguments\.max_grad_norm$"),
    ("steps_per_print", 0, r"^steps_per_print: 0 is not an integer >= 1"),
    ("wall_clock_breakdown", "false", r"^wall_clock_breakdown: 'false' is not true or false"),
    ("bf16.enabled", 1, r"^bf16\.enabled: 1 is not true or false"),
    ("bf16.enabled", "auto", HF_AUTO_ONE + r"bf16\.enabled: TrainingArguments\.bf16 \(true or false\)$"),
    ("fp16.loss_scale", -1, r"^fp16\.loss_scale: -1 is not a number >= 0"),
    ("fp16.initial_scale_power", 16.5, r"^fp16\.initial_scale_power: 16\.5 is not an integer"),
    ("fp16.loss_scale_window", 0, r"^fp16\.loss_scale_window: 0 is not an integer >= 1"),
    ("fp16.hysteresis", 0, r"^fp16\.hysteresis: 0 is not an integer >= 1"),
    ("fp16.min_loss_scale", 0, r"^fp16\.min_loss_scale: 0 is not a number > 0"),
    ("optimizer.type", "Lamb", r"^optimizer\.type: 'Lamb' is not one of Adam, AdamW"),
    ("optimizer.type", DELETE, r"^optimizer\.type: missing"),
    ("optimizer.params.lr", "auto", HF_AUTO_ONE + r"optimizer\.params\.lr: TrainingArguments\.learning_rate$"),
    ("optimizer.params.lr", -1e-3, r"^optimizer\.params\.lr: -0\.001 is not a number >= 0"),
    ("optimizer.params.betas", [0.9, 1.0], r"^optimizer\.params\.betas\[1\]: 1\.0 is not a number in \[0, 1\)"),
    ("optimizer.params.betas", [0.9], r"^optimizer\.params\.betas: \[0\.9\] is not a list of two numbers"),
    ("optimizer.params.eps", 0, r"^optimizer\.params\.eps: 0 is not a number > 0"),
    ("optimizer.params.weight_decay", -0.1, r"^optimizer\.params\.weight_decay: -0\.1 is not a number >= 0"),
    ("optimizer.params.adam_w_mode", False, r"^optimizer\.params\.adam_w_mode: false contradicts type 'AdamW'"),
    ("scheduler.type", "OneCycle", r"^scheduler\.type: 'OneCycle' is not one of WarmupLR, WarmupDecayLR, "
                                   r"WarmupCosineLR$"),
    ("scheduler.params.total_num_steps", DELETE,
     r"^scheduler\.params\.total_num_steps: missing \(required by WarmupDecayLR\)"),
    ("scheduler.params.warmup_num_steps", -1, r"^scheduler\.params\.warmup_num_steps: -1 is not an integer >= 0"),
    ("scheduler.params.warmup_type", "cosine", r"^scheduler\.params\.warmup_type: 'cosine' is not one of log, "
                                               r"linear"),
    ("scheduler.params.warmup_max_lr", "auto", HF_AUTO_ONE + r"scheduler\.params\.warmup_max_lr: "),
    ("aio.block_size", 1000, r"^aio\.block_size: 1000 is not an integer >= 4096"),
    ("aio.block_size", 4096 * 3 + 1, r"^aio\.block_size: 12289 is not a positive multiple of 4096"),
    ("aio.queue_depth", 0, r"^aio\.queue_depth: 0 is not an integer in \[1, 1024\]"),
    ("aio.intra_op_parallelism", 65, r"^aio\.intra_op_parallelism: 65 is not an integer in \[1, 64\]"),
    ("aio.backend", "io_uring", r"^aio\.backend: 'io_uring' is not one of auto, native, libaio, threads"),
    ("memory", {"host_budget": "8 gigs"}, r"^memory\.host_budget: '8 gigs' is not a byte size"),
    ("memory", {"device_budget": -1}, r"^memory\.device_budget: -1 is not an integer >= 0"),
    ("memory", {"host_budget": "256MiB", "pinned_budget": "512MiB"},
     r"^memory\.pinned_budget: 536870912 bytes is more than memory\.host_budget \(268435456\)"),
    ("fp16", {"enabled": True}, r"^bf16\.enabled and fp16\.enabled are both true"),
    ("compile", {"modules": "Block"}, r"^compile\.modules: 'Block' is not a list of module class names"),
    ("compile", {"modules": ["Block", "Block"]}, r"^compile\.modules: .* is not a list without repeated"),
    ("compile", {"enabled": False, "modules": ["Block"]}, r"^compile: enabled is false but modules names"),
    ("compile", {"enabled": "yes"}, r"^compile\.enabled: 'yes' is not true or false"),
    ("compile", {"backend": ""}, r"^compile\.backend: '' is not a torch\.compile backend name"),
    ("compile", {"mode": 3}, r"^compile\.mode: 3 is not a torch\.compile mode"),
    ("compile", {"fullgraph": 1}, r"^compile\.fullgraph: 1 is not true or false"),
    ("compile", {"modulse": ["Block"]}, r"compile\.modulse.*modules"),
])
def test_bad_values_name_the_key(path, value, message):
    with pytest.raises(ConfigError, match=message):
        Config.load(with_(path, value))


@pytest.mark.parametrize("device", ["none", "cpu"])
def test_nvme_only_keys_beside_another_device_are_named_as_having_no_effect(device):
    """A shared DeepSpeed config keeps its nvme_path (and NVMe buffer sizes) while
    "device" says "cpu": it loads, the keys are dropped, and each is named once."""
    d = with_("zero_optimization.offload_param.device", device)
    d = with_("zero_optimization.offload_optimizer", {"device": device, "nvme_path": "/local_nvme",
                                                       "buffer_count": 4, "pin_memory": True}, base=d)
    c = Config.load(d)
    notes = dict(c.no_effect())
    for key, value in (("offload_param.nvme_path", "'/local_nvme'"), ("offload_param.buffer_count", "5"),
                       ("offload_optimizer.nvme_path", "'/local_nvme'"), ("offload_optimizer.buffer_count", "4")):
        assert notes[f"zero_optimization.{key}"] == (
            f"{value} has no effect: it is used only when zero_optimization.{key.split('.')[0]}.device is "
            f"'nvme' or 'auto' (it is '{device}')"), notes
    zero = c.zero_optimization
    assert zero.offload_param.nvme_path is zero.offload_optimizer.nvme_path is None
    assert "unused" not in zero.offload_param.to_dict() and "nvme_path" not in zero.offload_param.to_dict()
    plain = with_("zero_optimization.offload_param", {"device": device, "pin_memory": True})
    plain = with_("zero_optimization.offload_optimizer", {"device": device, "pin_memory": True}, base=plain)
    assert c == Config.load(plain)  # no effect on any setting
    assert "zero_optimization.offload_param.nvme_path: '/local_nvme' has no effect" in c.no_effect_line()
    # auto uses an nvme_path (for what does not fit in memory): kept, no note
    auto = Config.load(with_("zero_optimization.offload_param.device", "auto"))
    assert auto.zero_optimization.offload_param.nvme_path is not None
    assert not [k for k, _ in auto.no_effect() if "offload_param" in k]
    # pin_memory is honoured whatever the device (Note [pin_memory] in sections.py): not refused
    assert Config.load(with_("zero_optimization.offload_param", {"pin_memory": False})
                       ).zero_optimization.offload_param.pin_memory is False


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match=r"^zero_optimization\.stage: 1 is not 3"):
        ZeroConfig(stage=1)
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.device: 'disk'"):
        OffloadParamConfig(device="disk")
    with pytest.raises(TypeError):
        ZeroConfig(3)  # keyword-only
    z = ZeroConfig(offload_param={"device": "cpu"})
    assert z.offload_param == OffloadParamConfig(device=Tier.HOST)
    with pytest.raises(dataclasses_frozen()):
        z.stage = 3


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_optimizer_adam_w_mode_semantics_follow_deepspeed():
    def opt(kind, **params):
        return Config.load({"optimizer": {"type": kind, "params": params}}).optimizer

    assert opt("Adam").type is OptimizerType.ADAM
    assert opt("Adam").effective_type is OptimizerType.ADAMW  # DeepSpeed: adam_w_mode defaults to true
    assert opt("adam", adam_w_mode=False).effective_type is OptimizerType.ADAM
    assert not opt("Adam", adam_w_mode=False).decoupled_weight_decay
    assert opt("adamw").type is OptimizerType.ADAMW and opt("ADAMW").decoupled_weight_decay
    assert Config.load({"optimizer": {"type": "AdamW"}}).optimizer.lr == 1e-3


def test_scheduler_params_defaults_per_type():
    s = Config.load({"scheduler": {"type": "WarmupLR"}}).scheduler
    assert s.params.warmup_max_lr is None and s.params.warmup_num_steps == 1000
    s = Config.load({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50}}}).scheduler
    assert s.params.cos_min_ratio == 0.0001 and s.params.warmup_min_ratio == 0.0
    with pytest.raises(ConfigError, match=r"unknown key 'scheduler\.params\.warmup_max_lr' \(did you mean "):
        Config.load({"scheduler": {"type": "WarmupCosineLR",
                                   "params": {"total_num_steps": 5, "warmup_max_lr": 1e-3}}})


def test_byte_sizes():
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5 KiB") == 1536 and parse_bytes(4096) == 4096 and parse_bytes("100") == 100
    m = Config.load({"memory": {"device_budget": "2GiB", "host_budget": 3 << 30, "pinned_budget": None}}).memory
    assert (m.device_budget, m.host_budget, m.pinned_budget) == (2 << 30, 3 << 30, None)
    assert Config.load({"memory": {"pinned_budget": "1GB"}}).memory.pinned_budget == 10**9
    with pytest.raises(ConfigError, match=r"memory\.pinned_budget: '1\.0000000001 B' is not a whole number"):
        Config.load({"memory": {"pinned_budget": "1.0000000001 B"}})
    with pytest.raises(ConfigError, match=r"memory\.device_budget: True is not an integer"):
        Config.load({"memory": {"device_budget": True}})


def test_resolve_auto_from_model():
    c = Config.load(DS_ZERO_INFINITY).resolve_auto(4096, 7_000_000_000, world_size=2)
    z = c.zero_optimization
    assert z.reduce_bucket_size == 4096 ** 2
    assert z.stage3_prefetch_bucket_size == int(0.9 * 4096 ** 2)
    assert z.stage3_param_persistence_threshold == 40960
    assert z.sub_group_size == 1_000_000_000  # given, not auto
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (64, 8, 4)
    assert not c.has_auto()
    all_auto = {"zero_optimization": {n: "auto" for n in ZeroConfig.SIZES}}
    z = Config.load(all_auto).resolve_auto(None, 1000)
    assert (z.zero_optimization.reduce_bucket_size, z.zero_optimization.stage3_prefetch_bucket_size,
            z.zero_optimization.stage3_param_persistence_threshold, z.zero_optimization.sub_group_size,
            z.zero_optimization.stage3_max_live_parameters) == (None, None, 100_000, 1000, None)
    assert repr(AUTO) == "auto" and copy.deepcopy(AUTO) is AUTO


def test_batch_rules_follow_deepspeed():
    def resolved(ws, **d):
        c = Config.load(d).resolve_auto(None, 10, world_size=ws)
        return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps

    assert resolved(2, train_batch_size=32, train_micro_batch_size_per_gpu=4) == (32, 4, 4)  # gas derived
    assert resolved(2, train_batch_size=32, gradient_accumulation_steps=4) == (32, 4, 4)
    assert resolved(2, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4) == (32, 4, 4)
    assert resolved(4, train_batch_size=32) == (32, 8, 1)
    assert resolved(4, train_micro_batch_size_per_gpu=2) == (8, 2, 1)
    assert resolved(1) == (None, None, 1)
    assert resolved(2, train_batch_size=32, train_micro_batch_size_per_gpu="auto",
                    gradient_accumulation_steps="auto") == (32, 16, 1)
    with pytest.raises(ConfigError, match=HF_AUTO_ONE + r"train_micro_batch_size_per_gpu: "):
        resolved(1, train_micro_batch_size_per_gpu="auto")
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps: cannot be derived: train_batch_size 30"):
        resolved(4, train_batch_size=30, train_micro_batch_size_per_gpu=4)


def test_check_batch():
    c = Config.load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    c.check_batch(4)
    with pytest.raises(ConfigError, match=r"^train_batch_size: 32 != train_micro_batch_size_per_gpu 4 \* "
                                          r"gradient_accumulation_steps 2 \* world size 2 \(= 16\)"):
        c.check_batch(2)
    Config.load({"train_batch_size": 32}).check_batch(3)  # partial: nothing to check
    with pytest.raises(ConfigError, match=r"check_batch: world_size: 0"):
        c.check_batch(0)


def test_offload_device_auto_round_trips_and_keeps_the_nvme_keys():
    """"device": "auto" (Note [automatic placement]): a value of `device`, not a key of its own."""
    d = {"zero_optimization": {"offload_param": {"device": "auto", "nvme_path": "/nvme", "buffer_count": 4},
                               "offload_optimizer": {"device": "auto"}}}
    cfg = Config.from_dict(d)
    zero = cfg.zero_optimization
    assert zero.offload_param.auto and zero.offload_optimizer.auto
    assert zero.offload_param.buffer_count == 4  # an nvme-only key, for the overflow
    assert zero.offload_optimizer.grad_tier is Tier.HOST  # gradients wait on the host
    out = cfg.to_dict()["zero_optimization"]
    assert out["offload_param"]["device"] == "auto" and "auto" not in out["offload_param"]
    assert Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"unknown key 'zero_optimization\.offload_param\.auto'"):
        Config.from_dict({"zero_optimization": {"offload_param": {"auto": True}}})


def test_hugging_faces_zero3_config_names_every_auto_the_trainer_fills_in_one_error():
    with pytest.raises(ConfigError) as err:
        Config.load(HF_ZERO3)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("11 config values are 'auto', which Hugging Face's Trainer fills in")
    assert [line.split(":")[0].strip() for line in lines[1:]] == list(HF_ZERO3_FILLED)
    assert "  gradient_clipping: TrainingArguments.max_grad_norm" in lines
    # the autos offload resolves itself (sizes from the model, batch sizes from each other) are not named
    assert not [line for line in lines if "bucket" in line or "train_batch_size:" in line]


def test_hugging_faces_zero3_config_with_the_trainers_values_loads_and_resolves():
    c = Config.load(filled()).resolve_auto(hidden_size=64, num_params=10_000)
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.train_batch_size) == (4, 1, 4)
    assert c.gradient_clipping == 1.0 and c.optimizer.lr == 5e-5
    assert c.zero_optimization.reduce_bucket_size == 64 * 64


@pytest.mark.parametrize("given,want", [
    ({"train_batch_size": 32}, (32, 32, 1)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, (32, 8, 4)),
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, (16, 8, 2)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 8}, (24, 8, 3)),
])
def test_any_two_batch_sizes_give_the_third_at_initialize_as_deepspeed(given, want):
    import offload

    cfg = {**given, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    import offload.deepspeed

    engine, *_ = offload.deepspeed.initialize(model=torch.nn.Linear(4, 4), config=cfg)
    with engine:
        got = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
    assert engine.config.train_batch_size == want[0]  # the Engine's config holds the three
    assert got == want


def test_batch_sizes_that_disagree_are_refused_at_initialize_naming_each():
    import offload

    cfg = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match=r"train_batch_size: 32 != train_micro_batch_size_per_gpu 8 \* "
                                          r"gradient_accumulation_steps 3 \* world size 1 \(= 24\)"):
        offload.initialize(torch.nn.Linear(4, 4), cfg)


# ---- the shard group (Note [hybrid sharding] in offload/transfers/layout.py) ----

@pytest.mark.parametrize("zero, size", [
    ({}, "node"),
    ({"shard_group_size": "world"}, "world"),
    ({"shard_group_size": 4}, 4),
    ({"mics_shard_size": 4}, 4),
    ({"mics_shard_size": -1}, "node"),
    ({"zero_hpz_partition_size": 2}, 2),
    ({"zero_hpz_partition_size": 1}, "node"),
    ({"zero_hpz_partition_size": 2, "mics_shard_size": 2, "shard_group_size": 2.0}, 2),
])
def test_the_shard_group_is_named_by_our_key_or_deepspeeds(zero, size):
    cfg = Config.from_dict({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                            "zero_optimization": {"stage": 3, **zero}})
    assert cfg.zero_optimization.group_size == size


@pytest.mark.parametrize("zero, message", [
    ({"shard_group_size": 0}, r"shard_group_size: 0 is not \"node\""),
    ({"shard_group_size": "nodes"}, r"shard_group_size: 'nodes' is not"),
    ({"shard_group_size": True}, r"shard_group_size: True is not"),
    ({"mics_shard_size": 0}, r"mics_shard_size: 0 is not a number of ranks, or -1"),
    ({"zero_hpz_partition_size": 0}, r"zero_hpz_partition_size"),
    ({"zero_hpz_partition_size": 2, "mics_shard_size": 4}, r"zero_hpz_partition_size 2, mics_shard_size 4 name "
                                                            r"different shard groups"),
    ({"shard_group_size": "world", "mics_shard_size": 4}, r"mics_shard_size 4, shard_group_size 'world'"),
])
def test_a_wrong_shard_group_is_refused_by_name(zero, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                          "zero_optimization": {"stage": 3, **zero}})


def test_hpz_says_how_it_differs_and_the_hierarchical_gather_that_it_has_no_effect():
    cfg = Config.from_dict({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8,
                                                  "mics_hierarchical_params_gather": True}})
    notes = dict(cfg.no_effect())
    assert "not partitioned over every rank" in notes["zero_optimization.zero_hpz_partition_size"]
    assert "has no effect" in notes["zero_optimization.mics_hierarchical_params_gather"]
