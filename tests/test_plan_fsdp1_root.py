"""FSDP1's root unit holds an untied input embedding gathered once through backward (plan/estimate.py
`embedding_in_root`): a 2-rank gloo trace of torch's FullyShardedDataParallel over a tiny untied Llama, its decoder
blocks wrapped and the embedding, norm and head in the root, as Lightning and accelerate wrap them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port

VOCAB, HIDDEN = 4096, 64


def _probe() -> None:  # runs on each rank, under torch.distributed.run
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = FullyShardedDataParallel(LlamaForCausalLM(cfg), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD)
    root = model._handle.flat_param

    def gathered() -> tuple[int, int]:  # (bytes, address) of the root's unsharded flat parameter; 0 bytes if freed
        storage = root._full_param_padded.untyped_storage()
        return storage.nbytes(), storage.data_ptr()

    in_backward = []
    model._fsdp_wrapped_module.model.layers[0].register_full_backward_hook(lambda *_: in_backward.append(gathered()))
    ids = torch.randint(0, VOCAB, (1, 8))
    loss = model(input_ids=ids, labels=ids).loss
    after_forward = gathered()
    loss.backward()
    if dist.get_rank() == 0:
        print(json.dumps({"after_forward": after_forward, "in_backward": in_backward,
                          "after_backward": gathered()[0], "root_params": root._unpadded_unsharded_size.numel()}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp1_root_holds_the_embedding_once_through_backward() -> None:
    """After forward the root's flat parameter (embedding, final norm, head) is still gathered, stays so, in the
    same buffer, through the blocks' backward and is freed after it: one copy, never gathered again (FSDP2 frees
    the embedding's unit after forward and gathers it again for its gradient: one copy in backward either way,
    what the planner counts)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), str(Path(__file__))], capture_output=True, text=True, timeout=300, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    size, address = out["after_forward"]
    assert out["root_params"] == 2 * VOCAB * HIDDEN + HIDDEN and size >= 4 * out["root_params"]
    assert out["in_backward"] == [[size, address]] and out["after_backward"] == 0


if __name__ == "__main__":
    _probe()
