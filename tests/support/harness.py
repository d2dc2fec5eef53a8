"""Runs the same training on the engine and on plain PyTorch, step by step."""
import copy

import torch
from torch.nn import functional as F

import offload
from tests.support.models import MODELS, VOCAB
from tests.support.layer_under_test import test_device


def make_config(param: str, optim: str, nvme_path, *, precision="fp32", gas=1, clip=0.0,
                lr=1e-2, weight_decay=0.01, persistence=0, scheduler=None, extra=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": persistence,
            "offload_param": {"device": param},
            "offload_optimizer": {"device": optim},
        },
    }
    if param == "nvme":
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(nvme_path)
    if optim == "nvme":
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(nvme_path)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    cfg.update(extra or {})
    return cfg


def batches(steps, *, world=1, seed=0, seq=7):
    """Per step, a list of `world` (input, target) micro-batches of token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (3, seq), generator=gen),
              torch.randint(0, VOCAB, (3, seq), generator=gen)) for _ in range(world)]
            for _ in range(steps)]


def on_test_device(*tensors):
    """The tensors on the device the test runs on (Note [the device a test runs on]
    in tests/conftest.py): a GPU's for OFFLOAD_TEST_DEVICE=cuda, else the host."""
    device = test_device()
    return tuple(t.to(device) for t in tensors)


def lm_loss(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def run_reference(model, data, *, gas, clip, lr, weight_decay, world=1, scheduler_fn=None):
    """Plain PyTorch: AdamW, loss / gas per micro-step (averaged over the ranks' batches),
    on the device the test runs on; the model and losses come back on the host."""
    model = copy.deepcopy(model).to(test_device())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=weight_decay, foreach=False)
    sched = scheduler_fn(opt) if scheduler_fn else None
    losses = []
    for i, per_rank in enumerate(data):
        step_losses = []
        for x, y in per_rank:
            x, y = on_test_device(x, y)
            loss = lm_loss(model(x), y)
            (loss / (gas * world)).backward()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses))
        if (i + 1) % gas == 0:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
    return model.cpu(), torch.stack(losses).cpu()


def run_reference_mixed(model, data, *, dtype, gas, lr, weight_decay, world=1, state_on_device=False,
                        before_step=None):
    """Plain PyTorch mixed precision: a `dtype` copy computes, fp32 masters step,
    gradients accumulate in fp32, the copy is refreshed after each step.

    The masters step where the engine's do, by the same arithmetic: an fp32
    ulp of difference in a master can flip its bf16 rounding, and that flip
    grows over steps, hiding what this reference checks, the engine's
    mixed-precision bookkeeping. On the host, offload.optim.CPUAdam (equal to
    torch.optim.AdamW element by element, tests/optim/test_cpu_adam.py);
    state_on_device (the engine's optimizer state on a GPU: "none", or an auto
    plan with room), torch's fused AdamW there, as the engine updates it:
    True for every parameter, or the set of names whose state the engine's
    plan put on the device. On the cpu layer and the sim the engine's device
    state steps with the host kernel, so state_on_device changes nothing there.
    before_step(compute, i): a user's edit of the `dtype` model before micro-step i; each
    parameter it changed is taken into its master, as the engine takes a write."""
    from offload.optim import CPUAdam

    master = copy.deepcopy(model)
    on_gpu = set()
    if test_device().type == "cuda" and state_on_device:
        on_gpu = {n for n, _ in master.named_parameters() if state_on_device is True or n in state_on_device}
    for name, p in master.named_parameters():
        if name in on_gpu:
            p.data = p.data.to(test_device())
    compute = copy.deepcopy(model).to(test_device(), dtype)
    named = list(master.named_parameters())
    opts = []
    if len(on_gpu) < len(named):
        opts.append(CPUAdam([p for n, p in named if n not in on_gpu], lr=lr, weight_decay=weight_decay))
    if on_gpu:
        opts.append(torch.optim.AdamW([p for n, p in named if n in on_gpu], lr=lr, weight_decay=weight_decay,
                                      fused=True))
    pairs = list(zip(master.parameters(), compute.parameters()))
    losses = []
    for i, per_rank in enumerate(data):
        if before_step is not None:
            before = [p16.detach().clone() for _, p16 in pairs]
            before_step(compute, i)
            with torch.no_grad():
                for (p32, p16), old in zip(pairs, before):
                    if not torch.equal(p16, old):
                        p32.copy_(p16)
        step_losses, rank_grads = [], []
        for x, y in per_rank:  # each rank's micro-batch; gradients averaged in fp32
            x, y = on_test_device(x, y)
            loss = lm_loss(compute(x), y)
            (loss / gas).backward()
            rank_grads.append([None if p16.grad is None else p16.grad.float().to(p32.device) for p32, p16 in pairs])
            compute.zero_grad(set_to_none=True)
            step_losses.append(loss.detach())
        for j, (p32, _) in enumerate(pairs):
            grads = [g[j] for g in rank_grads if g[j] is not None]
            if grads:
                mean = grads[0] if world == 1 else sum(grads[1:], grads[0]) / world
                p32.grad = mean if p32.grad is None else p32.grad + mean
        losses.append(torch.stack(step_losses))
        if (i + 1) % gas == 0:
            for opt in opts:
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                for p32, p16 in pairs:
                    p16.copy_(p32)
    return master.cpu(), torch.stack(losses).cpu()


def train_engine(engine, data, *, rank=0, before_step=None):
    """This rank's micro-batches of `data` (batches()) through `engine`, a
    backward and step after each; returns the losses (fp32).
    before_step(engine, i): called before micro-step i (to disturb the engine mid-run)."""
    losses = []
    for i, per_rank in enumerate(data):
        x, y = on_test_device(*per_rank[rank])
        if before_step is not None:
            before_step(engine, i)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return torch.stack(losses).cpu()


def run_engine(model, data, config, *, rank=0):
    """The engine on this rank's micro-batches; returns final full weights and losses."""
    model = copy.deepcopy(model)
    with offload.initialize(model, config) as engine:
        losses = train_engine(engine, data, rank=rank)
        weights = engine_weights(engine)
    return weights, losses, engine


def engine_weights(engine):
    """Every parameter's current full value (fp32 masters where the engine keeps them)."""
    return {name: value.detach().cpu().clone() for name, value in engine.full_state_dict(master=True).items()}


def assert_weights(engine, ref_model, **tolerance):
    """The engine's full weights equal `ref_model`'s, parameter by parameter."""
    weights = engine_weights(engine)
    expected = dict(ref_model.named_parameters())
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name].detach(), msg=lambda m: f"{name}: {m}", **tolerance)


def build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]()


def first_race(exc: BaseException) -> BaseException:
    """The sim's first StreamOrderError in a chain: the race itself, before any error
    the cleanup after it raised (freeing a buffer its unwaited copy still used)."""
    from offload.device.sim_memory import StreamOrderError

    while isinstance(exc.__context__, StreamOrderError):
        exc = exc.__context__
    return exc
