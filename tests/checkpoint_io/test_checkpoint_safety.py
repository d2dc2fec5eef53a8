"""Checkpoints as untrusted input and as the user's intent: no code run from a file
(Note [no code from a checkpoint]), nothing outside the checkpoint read (Note [manifest
paths]), optimizer settings never silently replaced (Note [optimizer settings at load]),
and saves inside an accumulation window resumed exactly (Note [saving inside an
accumulation window])."""
import builtins
import io
import json
import os
import shutil
import sys

import pytest
import torch
from safetensors import safe_open

import offload
from offload.checkpoint_io import CheckpointError, files
from tests.checkpoint_io import checkpoint_runs as runs
from tests.support.harness import build, make_config
from tests.support.models import TinyGPT
from tests.checkpoint_io.checkpoint_runs import assert_same_state, engine_state


def _engine(root, param="cpu", optim="cpu", seed=0, **kw):
    kw.setdefault("scheduler", runs.WARMUP)
    return offload.initialize(build("tiny_gpt", seed), make_config(param, optim, root / f"swap{seed}", **kw))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after 2 steps (cpu parameters, NVMe optimizer state)."""
    root = tmp_path_factory.mktemp("saved")
    with _engine(root, "cpu", "nvme") as e:
        runs.train(e, 2)
        e.save_checkpoint(root / "ck", client_state={"epoch": 1, "t": torch.arange(3)})
    return root / "ck"


def _copy(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck, symlinks=True)
    return ck, ck / "global_step2"


def _rewrite(tag_dir, rel, data: bytes, manifest_change=None):
    """Replaces a file and updates the manifest to match: what an attacker who hands over the
    whole checkpoint can do (the checksums protect against corruption, not against them)."""
    (tag_dir / rel).write_bytes(data)
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    manifest["files"][rel] = {"bytes": len(data), "crc": files.crc_bytes(data)}
    if manifest_change is not None:
        manifest_change(manifest)
    (tag_dir / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    """Unpickling it creates `marker` (builtins.open(marker, "w")): code run from a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


class _UserObject:
    """A user's own class: fine in a pickle, more than weights_only loads."""


def _pickle(obj) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


# ---- no code run from a checkpoint ---------------------------------------------------
def test_crafted_client_state_pickle_is_refused_and_never_run(tmp_path, saved):
    ck, tag_dir = _copy(saved, tmp_path)
    marker = tmp_path / "marker"
    _rewrite(tag_dir, "rank0/client_state.pt", _pickle({"epoch": _Payload(marker)}))
    with _engine(tmp_path, "cpu", "nvme", seed=3) as e:
        runs.train(e, 1)
        before = engine_state(e)
        with pytest.raises(CheckpointError, match=r"client_state.pt: refused.*Unsupported global: "
                                                  r"GLOBAL io.open\); nothing in it was run"):
            e.load_checkpoint(ck)
        assert_same_state(before, engine_state(e))
    assert not marker.exists()


def test_format_version_1_pickled_engine_state_is_refused_by_version_and_never_run(tmp_path, saved):
    """Version 1 kept its engine state in a pickle: refused by name, never unpickled;
    consolidation still takes its weights out (it reads tensors only)."""
    ck, tag_dir = _copy(saved, tmp_path)
    marker = tmp_path / "marker"
    _rewrite(tag_dir, "rank0/engine_state.pt", _pickle({"global_steps": _Payload(marker)}),
             lambda m: m.update(version=1))
    with _engine(tmp_path, "cpu", "nvme", seed=3) as e:
        with pytest.raises(CheckpointError, match=r"checkpoint format version 1, this offload loads version 2"
                                                  r".*pickle.*offload consolidate"):
            e.load_checkpoint(ck)
    offload.consolidate(ck, tmp_path / "model.safetensors", progress=False)
    assert not marker.exists()


def test_load_reads_engine_state_as_json_and_client_state_weights_only(tmp_path, saved, monkeypatch):
    ck, tag_dir = _copy(saved, tmp_path)
    json.loads((tag_dir / "rank0/engine_state.json").read_text())  # plain JSON
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw.get("weights_only")) or real_load(*a, **kw))
    with _engine(tmp_path, "cpu", "nvme", seed=3) as e:
        _, client = e.load_checkpoint(ck)
    assert calls == [True]
    assert client["epoch"] == 1 and torch.equal(client["t"], torch.arange(3))


def test_client_state_that_needs_more_than_weights_only_is_refused_at_save(tmp_path):
    with _engine(tmp_path) as e:
        runs.train(e, 1)
        with pytest.raises(TypeError, match=r"client_state=.*GLOBAL tests.checkpoint_io.test_checkpoint_safety."
                                            r"_UserObject\). Allowed: tensors, numbers, strings"):
            e.save_checkpoint(tmp_path / "ck", client_state={"x": _UserObject()})
        e.save_checkpoint(tmp_path / "ck", client_state={"ok": [1, 2.5, "s", None, (torch.ones(2),)]})
    assert (tmp_path / "ck" / "latest").read_text().strip() == "global_step1"


# ---- nothing outside the checkpoint read -------------------------------------------
def _outside(tmp_path):
    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"x" * 1234)
    return secret


PATHS = {
    "dot-dot": lambda secret: "../../outside/secret",
    "dot-dot inside a rank": lambda secret: "rank0/../../../outside/secret",
    "absolute": lambda secret: str(secret),
    "not normalised": lambda secret: "rank0/./state.safetensors",
    "a rank the checkpoint does not have": lambda secret: "rank1/state.safetensors",
}


class _Touched:
    """Every path opened (the audit hook sees builtins.open and os.open) or stat'ed."""

    def __init__(self, monkeypatch):
        self.paths = []
        self.on = True
        real_stat = os.stat

        def stat(path, *a, **kw):
            if self.on:
                self.paths.append(os.fspath(path))
            return real_stat(path, *a, **kw)

        monkeypatch.setattr(os, "stat", stat)
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if self.on and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.fsdecode(args[0]))

    def outside(self, secret):
        return [p for p in self.paths if p.startswith(str(secret.parent))]


@pytest.mark.parametrize("what", sorted(PATHS))
def test_manifest_path_outside_the_checkpoint_is_refused_before_any_read(tmp_path, saved, monkeypatch, what):
    ck, tag_dir = _copy(saved, tmp_path)
    secret = _outside(tmp_path)
    rel = PATHS[what](secret)
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    manifest["files"][rel] = {"bytes": 1, "crc": 0}  # a wrong size would have told the secret's
    (tag_dir / "manifest.json").write_text(json.dumps(manifest))
    with _engine(tmp_path, "cpu", "nvme", seed=3) as e:
        before = engine_state(e)
        touched = _Touched(monkeypatch)
        try:
            with pytest.raises(CheckpointError, match=r"lists files that are not files of a checkpoint of 1 "
                                                      r"rank\(s\).*nothing was read") as err:
                e.load_checkpoint(ck)
        finally:
            touched.on = False
        assert touched.outside(secret) == []
        assert "1234" not in str(err.value)
        assert_same_state(before, engine_state(e))


def test_symlink_leading_out_of_the_checkpoint_is_refused_before_any_read(tmp_path, saved, monkeypatch):
    ck, tag_dir = _copy(saved, tmp_path)
    secret = _outside(tmp_path)
    listed = tag_dir / "rank0/nvme/optim.0.swp"
    listed.unlink()
    listed.symlink_to(secret)
    with _engine(tmp_path, "cpu", "nvme", seed=3) as e:
        touched = _Touched(monkeypatch)
        try:
            with pytest.raises(CheckpointError, match=r"lead outside the checkpoint \(symbolic links\): "
                                                      r"rank0/nvme/optim.0.swp; nothing was read") as err:
                e.load_checkpoint(ck)
        finally:
            touched.on = False
        assert touched.outside(secret) == []
        assert "1234" not in str(err.value) and str(secret) not in str(err.value)


# ---- optimizer settings at load --------------------------------------------------------
def _changed(root, change, seed=3):
    cfg = make_config("cpu", "nvme", root / f"swap{seed}", scheduler=json.loads(json.dumps(runs.WARMUP)))
    change(cfg)
    return offload.initialize(build("tiny_gpt", seed), cfg)


CHANGES = {
    "lr": (lambda c: c["optimizer"]["params"].update(lr=0.3), r"optimizer.params.lr: saved 0.01, configured 0.3"),
    "weight decay": (lambda c: c["optimizer"]["params"].update(weight_decay=0.2),
                     r"optimizer.params.weight_decay: saved 0.01, configured 0.2"),
    "betas": (lambda c: c["optimizer"]["params"].update(betas=[0.5, 0.6]),
              r"optimizer.params.betas: saved \[0.9, 0.999\], configured \[0.5, 0.6\]"),
    "eps": (lambda c: c["optimizer"]["params"].update(eps=1e-6),
            r"optimizer.params.eps: saved 1e-08, configured 1e-06"),
    "type": (lambda c: c["optimizer"].update(type="Adam"), r"optimizer.type: saved 'AdamW', configured 'Adam'"),
    "scheduler": (lambda c: c["scheduler"]["params"].update(warmup_max_lr=0.5),
                  r"scheduler.params.warmup_max_lr: saved 0.02, configured 0.5"),
}


@pytest.mark.parametrize("what", sorted(CHANGES))
def test_changed_optimizer_settings_are_refused_naming_each_difference(tmp_path, saved, what):
    change, message = CHANGES[what]
    with _changed(tmp_path, change) as e:
        runs.train(e, 1)
        before = engine_state(e)
        with pytest.raises(CheckpointError, match=message + r".*use_config_hyperparameters=True"):
            e.load_checkpoint(saved)
        assert_same_state(before, engine_state(e))


def test_several_differences_are_all_named(tmp_path, saved):
    def change(c):
        c["optimizer"]["params"].update(lr=0.3, weight_decay=0.2)
        c["scheduler"]["params"].update(warmup_num_steps=9)
    with _changed(tmp_path, change) as e:
        with pytest.raises(CheckpointError, match=r"lr: saved 0.01, configured 0.3; optimizer.params.weight_decay"
                                                  r".*scheduler.params.warmup_num_steps: saved 5, configured 9"):
            e.load_checkpoint(saved)


def test_use_config_hyperparameters_keeps_the_moments_and_applies_the_config(tmp_path, saved):
    with _engine(tmp_path, "cpu", "nvme", seed=3) as same:
        same.load_checkpoint(saved)
        expected = engine_state(same)

    def change(c):
        c["optimizer"]["params"].update(lr=0.3, weight_decay=0.2, betas=[0.5, 0.6])
        c["scheduler"]["params"].update(warmup_max_lr=0.5)
    with _changed(tmp_path, change, seed=4) as e:
        e.load_checkpoint(saved, use_config_hyperparameters=True)
        got = engine_state(e)
        group = e.optimizer.param_groups[0]
        assert (group["weight_decay"], group["betas"]) == (0.2, (0.5, 0.6))
        # The configured schedule at the saved step (2): WarmupLR's log warmup to 0.5 over 5 steps.
        assert e.lr_scheduler.last_epoch == 2 and e.lr_scheduler.params.warmup_max_lr == 0.5
        assert group["lr"] == e.lr_scheduler._get_closed_form_lr()[0] == e.lr_scheduler.get_last_lr()[0]
        assert group["lr"] == pytest.approx(expected["lr"][0] * 25)
        runs.train(e, 1)  # trains on
    for name in expected["moments"]:
        assert torch.equal(got["moments"][name], expected["moments"][name]), name
    assert got["steps"] == expected["steps"] and got["counters"] == expected["counters"]


def test_load_without_optimizer_and_scheduler_states_takes_no_settings(tmp_path, saved):
    with _changed(tmp_path, CHANGES["lr"][0]) as e:
        e.load_checkpoint(saved, load_optimizer_states=False, load_lr_scheduler_states=False)
        assert e.optimizer.param_groups[0]["initial_lr"] == 0.3
        assert e.optimizer.defaults["lr"] == 0.3


def test_model_mismatch_error_is_capped(tmp_path, saved):
    with offload.initialize(TinyGPT(hidden=27), make_config("cpu", "nvme", tmp_path / "swap")) as e:
        with pytest.raises(CheckpointError, match=r"and \d+ more$"):
            e.load_checkpoint(saved)


def test_consolidated_file_does_not_carry_the_checkpoint_path(tmp_path, saved):
    out = offload.consolidate(saved, tmp_path / "model.safetensors", progress=False)
    with safe_open(str(out), framework="pt") as f:
        metadata = f.metadata()
    assert str(saved) not in json.dumps(metadata)
    assert metadata["offload.source"] == "checkpoint tag global_step2"


# ---- saves inside an accumulation window -------------------------------------------
GAS = 3


@pytest.mark.parametrize("tiers,async_save", [(("cpu", "cpu"), False), (("nvme", "nvme"), True),
                                              (("none", "cpu"), True)])
def test_save_inside_an_accumulation_window_resumes_exactly(tmp_path, tiers, async_save):
    """Saved after micro-step 4 (one into the second window of 3): the resumed run finishes
    that window with the saved partial gradients and equals the uninterrupted run bit for bit."""
    runs.seed(0)
    with _engine(tmp_path, *tiers, gas=GAS) as e:
        runs.train(e, 4)
        assert e.gradients_pending
        e.save_checkpoint(tmp_path / "ck", client_state={"at": 4}, async_save=async_save)
        losses = runs.train(e, 5)
        straight = runs.snapshot(e)
        e.wait_checkpoint()
    runs.seed(5, salt=9)
    with _engine(tmp_path, *tiers, gas=GAS, seed=7) as fresh:
        assert fresh.load_checkpoint(tmp_path / "ck")[1] == {"at": 4}
        assert (fresh.global_steps, fresh.micro_steps) == (1, 4)
        resumed_losses = runs.train(fresh, 5)
        resumed = runs.snapshot(fresh)
    torch.testing.assert_close(resumed_losses, losses, rtol=0, atol=0)
    for kind in ("master", "home"):
        for name, value in straight[kind].items():
            torch.testing.assert_close(resumed[kind][name], value, rtol=0, atol=0, msg=f"{kind} {name}")
