"""A checkpoint from a stranger cannot run code: DCP's `.metadata` is read by a restricted unpickler, the state's
non-tensor values with weights_only, and trainer.pt / rng-N.pt with weights_only. Crafted files end in a clean
UserError naming the file (exit 2 from `shardfit train`), and the code they carry never runs; a real checkpoint
still loads exactly. Each crafted pickle is first shown to run its code when unpickled plainly, so the tests
would fail if the loading were not restricted."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.parallel.env import DistEnv
from shardfit.train.checkpoint import load_checkpoint, save_checkpoint, write_manifest
from tests.helpers import write_config

ENV = DistEnv(0, 1, 0, torch.device("cpu"), None)


class _Call:
    """Pickles as a call of `fn(*args)`: what a crafted checkpoint hides in its pickles."""

    def __init__(self, fn: Callable[..., object], *args: object):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return self.fn, self.args


def _training_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A small model with a frozen layer, its AdamW state after two steps, and a schedule."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.8, 0.9))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    for _ in range(2):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    model, optimizer, scheduler = _training_state(seed=0)
    return save_checkpoint(tmp_path / "run", 2, 96, model, optimizer, scheduler, ENV, keep=2)


def _load(path: Path) -> None:
    model, optimizer, scheduler = _training_state(seed=1)
    load_checkpoint(path, model, optimizer, scheduler, ENV)


def test_a_real_checkpoint_still_loads_exactly(ckpt: Path) -> None:
    saved_model, saved_optimizer, saved_scheduler = _training_state(seed=0)
    model, optimizer, scheduler = _training_state(seed=1)
    resumed = load_checkpoint(ckpt, model, optimizer, scheduler, ENV)
    assert (resumed.step, resumed.tokens) == (2, 96)
    for (name, p), q in zip(model.named_parameters(), saved_model.parameters(), strict=True):
        if p.requires_grad:  # frozen weights come back from the base model, not the checkpoint
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    want, got = saved_optimizer.state_dict(), optimizer.state_dict()
    for key in ("lr", "betas", "eps", "weight_decay"):  # the non-tensor values, read with weights_only
        assert got["param_groups"][0][key] == want["param_groups"][0][key]
    for i, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=0, atol=0)
    assert scheduler.state_dict()["last_epoch"] == saved_scheduler.state_dict()["last_epoch"]


def _real_metadata(ckpt: Path) -> object:
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # our own checkpoint, just written: safe to unpickle plainly to edit it


def _write_marker(marker: Path) -> _Call:
    return _Call(exec, f"open({str(marker)!r}, 'w').write('code ran')")


def _hidden_in_real(ckpt: Path, marker: Path) -> bytes:
    metadata = _real_metadata(ckpt)
    metadata.planner_data = _write_marker(marker)  # type: ignore[attr-defined]
    return pickle.dumps(metadata)


def _shard_outside(ckpt: Path, marker: Path) -> bytes:
    metadata = _real_metadata(ckpt)
    index, info = next(iter(metadata.storage_data.items()))  # type: ignore[attr-defined]
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../../elsewhere.distcp")  # type: ignore
    return pickle.dumps(metadata)


CRAFTED = [  # name, the .metadata bytes (given the checkpoint and the marker path), runs code, the reason shown
    ("os.system", lambda c, m: pickle.dumps(_Call(os.system, f"touch '{m}'")), True, "system"),
    ("exec", lambda c, m: pickle.dumps(_write_marker(m)), True, "builtins.exec"),
    ("a call hidden in real metadata", _hidden_in_real, True, "builtins.exec"),
    ("a torch function that is not a dtype", lambda c, m: pickle.dumps(_Call(torch.load, str(m))), False,
     "torch.serialization.load"),
    ("a dict, not metadata", lambda c, m: pickle.dumps({"state_dict_metadata": {}}), False, "holds a dict"),
    ("a shard path leaving the checkpoint", _shard_outside, False, "not a file name inside the checkpoint"),
    ("a truncated file", lambda c, m: (c / ".metadata").read_bytes()[:40], False, ""),
    ("an empty file", lambda c, m: b"", False, ""),
]


@pytest.mark.parametrize(("name", "craft", "runs_code", "reason"), CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_metadata_is_refused_and_its_code_never_runs(ckpt: Path, tmp_path: Path, name: str,
                                                              craft: Callable[[Path, Path], bytes], runs_code: bool,
                                                              reason: str) -> None:
    marker = tmp_path / "marker"
    data = craft(ckpt, marker)
    if runs_code:  # the control: unpickled the way DCP does it, this file runs its code
        pickle.loads(data)
        assert marker.exists()
        marker.unlink()
    (ckpt / ".metadata").write_bytes(data)
    with pytest.raises(UserError) as err:
        _load(ckpt)
    assert str(ckpt / ".metadata") in str(err.value) and "not a checkpoint shardfit wrote" in str(err.value)
    assert reason in str(err.value)
    assert not marker.exists()


def test_a_crafted_value_in_the_shards_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """Metadata of only legitimate classes, pointing a non-tensor value (the learning rate) at a crafted pickle:
    DCP itself would torch.load it with weights_only=False."""
    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    torch.save(_write_marker(marker), buffer)
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # the control: loaded unrestricted, code runs
    assert marker.exists()
    marker.unlink()
    (ckpt / "__evil.distcp").write_bytes(buffer.getvalue())
    metadata = _real_metadata(ckpt)
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))  # type: ignore[attr-defined]
    metadata.storage_data[index] = dataclasses.replace(  # type: ignore[attr-defined]
        metadata.storage_data[index], relative_path="__evil.distcp", offset=0, length=len(buffer.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    value = r"its value train\.optim\.param_groups\.0\.lr: Unsupported global: GLOBAL exec "
    with pytest.raises(UserError, match=value):
        _load(ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["trainer.pt", "rng-0.pt"])
def test_crafted_trainer_and_rng_files_are_refused_cleanly(ckpt: Path, tmp_path: Path, name: str) -> None:
    marker = tmp_path / "marker"
    torch.save(_write_marker(marker), ckpt / name)
    with pytest.raises(UserError, match="not a checkpoint shardfit wrote") as err:
        _load(ckpt)
    assert str(ckpt / name) in str(err.value) and "GLOBAL exec was not an allowed global" in str(err.value)
    assert "Weights only load failed" not in str(err.value) and "add_safe_globals" not in str(err.value)
    assert not marker.exists()


def test_train_resuming_from_a_crafted_checkpoint_exits_2(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """The attack of issue 48 end to end: a run directory whose newest checkpoint carries a crafted `.metadata`
    and a manifest to match (whoever crafts a checkpoint writes one) is resumed by `shardfit train`."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), method="lora",
                       precision="fp32", max_seq_len=128, micro_batch=2, max_steps=2, save_steps=1, log_steps=1,
                       report_to="none", output_dir=str(run))
    assert main(["train", str(cfg)]) == 0
    newest = run / "checkpoints" / "step-2"  # what resume: auto picks
    assert newest.is_dir()
    marker = tmp_path / "marker"
    (newest / ".metadata").write_bytes(pickle.dumps(_Call(os.system, f"touch '{marker}'")))
    (newest / "manifest.json").unlink()
    write_manifest(newest)
    shutil.rmtree(run / "adapter", ignore_errors=True)
    (run / "summary.json").unlink()
    capsys.readouterr()
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{newest / '.metadata'}: not a checkpoint shardfit wrote" in err and "Traceback" not in err
    assert not marker.exists()
