"""model_parallel placement: the balanced split and the device map (CPU logic), and a real run (GPU-only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardfit.config import load_config
from shardfit.models.placement import device_map_for, split_layers
from shardfit.parallel.env import init_distributed
from shardfit.train.recipe import train
from tests.helpers import write_config


def test_split_is_balanced_by_memory() -> None:
    assert split_layers(32, [24.0] * 4, 0.0, 0.0) == [8, 8, 8, 8]
    counts = split_layers(32, [24.0] * 4, 6.0, 0.0)  # embeddings + head on the first GPU
    assert sum(counts) == 32 and counts[0] < min(counts[1:]) and max(counts[1:]) - min(counts[1:]) <= 1
    assert split_layers(12, [10.0, 30.0], 0.0, 0.0) == [3, 9]  # a bigger card takes more
    with pytest.raises(ValueError):
        split_layers(80, [1.0, 1.0], 0.0, 0.1)


def test_device_map_keeps_embeddings_norm_and_head_together(tiny_llama: Path) -> None:
    cfg = AutoConfig.from_pretrained(tiny_llama)
    cfg.num_hidden_layers = 6
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    dmap = device_map_for(model, [0, 1, 2], [1e9, 1e9, 1e9])
    layers = {k: v for k, v in dmap.items() if k.startswith("model.layers.")}
    assert sorted(layers) == sorted(f"model.layers.{i}" for i in range(6))
    assert list(layers.values()) == sorted(layers.values())  # consecutive blocks per device
    assert len(set(layers.values())) == 3
    for name in ("model.embed_tokens", "model.norm", "lm_head"):
        assert dmap[name] == 0  # tied weights stay one tensor; the loss never crosses devices
    # Every parameter is covered by exactly one entry.
    for pname, _ in model.named_parameters():
        owners = [k for k in dmap if pname == k or pname.startswith(k + ".")]
        assert len(owners) == 1, pname


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_model_parallel_trains_on_two_gpus(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), strategy="model_parallel",
                       max_seq_len=128, micro_batch=2, max_steps=3, output_dir=str(tmp_path / "run"))
    result = train(load_config(cfg), init_distributed(), quiet=True)
    devices = {p.device for p in result.model.parameters()}
    assert len(devices) == 2 and result.summary["strategy"] == "model_parallel"
