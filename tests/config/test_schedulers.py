"""offload.schedulers: DeepSpeed 0.19.8's LR schedules, float for float."""
import math
import warnings

import pytest
import torch

from offload.config import ConfigError, SchedulerConfig
from offload.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

STEPS = 30


def lr_sequence(make, steps=STEPS, lrs=(0.05,)):
    """The lr of every group after construction and after each of `steps` steps."""
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in lrs]
    opt = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])
    sched = make(opt)
    out = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
    return out


CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 7, "warmup_type": "linear"}),  # max = optimizer lr
    ("WarmupLR", {"warmup_num_steps": 1}),  # DeepSpeed warms up over at least 2 steps
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                       "warmup_num_steps": 10}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 5}),  # total < warmup
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_min_ratio": 0.1, "warmup_num_steps": 10}),
    ("WarmupCosineLR", {"total_num_steps": 17, "warmup_num_steps": 4, "warmup_type": "linear",
                        "cos_min_ratio": 0.05}),
    ("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 6}),  # total < warmup
]


def deepspeed_schedule(kind, params):
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules",
                             reason="deepspeed is not importable: the element-wise DeepSpeed comparison "
                                    "needs it (the closed-form tests still run)")
    return lambda opt: getattr(ds, kind)(opt, **params)


@pytest.mark.parametrize("kind, params", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
@pytest.mark.parametrize("lrs", [(0.05,), (0.05, 0.2)], ids=["1group", "2groups"])
def test_same_floats_as_deepspeed(kind, params, lrs):
    make_ds = deepspeed_schedule(kind, params)
    ours = lr_sequence(lambda opt: build_scheduler(opt, {"type": kind, "params": params}), lrs=lrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = lr_sequence(make_ds, lrs=lrs)
    assert ours == theirs  # exact, element by element


def test_warmup_lr_closed_form():
    seq = lr_sequence(lambda o: build_scheduler(o, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 8, "warmup_type": "linear"}}))
    lrs = [s[0] for s in seq]
    # Note [DeepSpeed step offset]: construction and the first step both give iteration <= 0.
    assert lrs[0] == 0.0 and lrs[1] == 0.0
    for k in range(1, STEPS + 1):
        assert lrs[k] == pytest.approx(min((k - 1) / 8, 1.0), abs=1e-15)
    log_seq = [s[0] for s in lr_sequence(lambda o: WarmupLR(o, SchedulerConfig.from_dict(
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.5,
                                        "warmup_num_steps": 10}}).params))]
    for k in range(1, STEPS + 1):
        it = k - 1
        expect = 0.1 + 0.4 * (math.log(it + 1) / math.log(10) if it < 10 else 1.0)
        assert log_seq[k] == pytest.approx(expect, rel=1e-12)


def test_warmup_lr_ignores_optimizer_lr_unless_max_missing():
    fixed = lr_sequence(lambda o: build_scheduler(o, {"type": "WarmupLR", "params": {
        "warmup_max_lr": 0.3, "warmup_num_steps": 2}}), lrs=(7.0,))
    assert fixed[-1] == [0.3]
    default = lr_sequence(lambda o: build_scheduler(o, {"type": "WarmupLR", "params": {
        "warmup_num_steps": 2}}), lrs=(7.0, 3.0))
    assert default[-1] == [7.0, 3.0]


def test_decay_closed_form():
    seq = [s[0] for s in lr_sequence(lambda o: build_scheduler(o, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 20, "warmup_max_lr": 1.0, "warmup_num_steps": 5, "warmup_type": "linear"}}))]
    for k in range(6, STEPS + 1):
        it = k - 1
        assert seq[k] == pytest.approx(max(0.0, (20 - it) / 15), abs=1e-15)
    assert seq[21:] == [0.0] * (STEPS - 20)


def test_cosine_closed_form():
    seq = [s[0] for s in lr_sequence(lambda o: build_scheduler(o, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.2, "cos_min_ratio": 0.1,
        "warmup_type": "linear"}}), lrs=(2.0,))]
    assert seq[0] == 0.0  # DeepSpeed: ratio 0 before the first step
    for k in range(1, STEPS + 1):
        it = k - 1
        if it < 5:
            ratio = 0.2 + 0.8 * it / 5
        else:
            progress = min(1.0, (it - 5 + 1) / 15)
            ratio = 0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2
        assert seq[k] == pytest.approx(2.0 * ratio, rel=1e-12)
    assert seq[-1] == pytest.approx(0.2)  # stays at cos_min_ratio * lr past the end


def test_state_dict_resume():
    cfg = {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}}
    full = lr_sequence(lambda o: build_scheduler(o, cfg), steps=12)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.05)
    sched = build_scheduler(opt, cfg)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    sched2 = build_scheduler(opt2, cfg)
    sched2.load_state_dict(state)
    got = []
    for _ in range(5):
        opt2.step()
        sched2.step()
        got.append([opt2.param_groups[0]["lr"]])
    assert got == full[8:13]


def test_classes_and_errors():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.05)
    assert isinstance(build_scheduler(opt, {"type": "WarmupDecayLR", "params": {"total_num_steps": 5}}),
                      WarmupDecayLR)
    assert isinstance(build_scheduler(opt, SchedulerConfig(type="WarmupCosineLR",
                                                           params={"total_num_steps": 5})), WarmupCosineLR)
    assert isinstance(build_scheduler(opt, {"type": "WarmupDecayLR", "params": {"total_num_steps": 5}}),
                      torch.optim.lr_scheduler.LRScheduler)
    with pytest.raises(ConfigError, match=r"scheduler\.type: 'OneCycle'"):
        build_scheduler(opt, {"type": "OneCycle"})
    with pytest.raises(TypeError, match="not a SchedulerConfig"):
        build_scheduler(opt, "WarmupLR")
