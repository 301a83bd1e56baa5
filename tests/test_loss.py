"""The chunked loss equals the plain loss, and packed rows give the same loss as unpacked ones."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from shardfit.data.formats import detect_format, to_messages
from shardfit.data.loader import collate
from shardfit.data.packing import no_pack, pack
from shardfit.data.tokenize import IGNORE, encode_messages
from shardfit.train.loss import CausalLMLoss, chunked_cross_entropy, plain_cross_entropy
from tests.helpers import DEMO_DATA


@pytest.mark.parametrize("head_trains", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_equals_plain_with_grads(head_trains: bool, chunk: int) -> None:
    torch.manual_seed(0)
    h = torch.randn(3, 40, 24, dtype=torch.float64, requires_grad=True)
    head = nn.Linear(24, 500, bias=False).double()
    head.weight.requires_grad_(head_trains)
    y = torch.randint(0, 500, (3, 40))
    y[:, :15] = IGNORE
    loss, n = chunked_cross_entropy(h, head, y, chunk=chunk)
    loss.backward()
    gh, gw = h.grad.clone(), head.weight.grad.clone() if head_trains else None
    h.grad, head.weight.grad = None, None
    ref, n_ref = plain_cross_entropy(head(h), y)
    ref.backward()
    assert n == n_ref == 75
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, h.grad, rtol=1e-6, atol=1e-8)
    if head_trains:
        torch.testing.assert_close(gw, head.weight.grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("head_trains", [False, True])
def test_a_forward_without_autograd_computes_the_loss_alone(head_trains: bool) -> None:
    """Evaluation runs under no_grad: the same loss, one matmul per chunk and no gradient buffers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ in ("mm", "addmm", "addmm_", "matmul")
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    h = torch.randn(2, 30, 16, requires_grad=True)
    head = nn.Linear(16, 300, bias=False).requires_grad_(head_trains)
    y = torch.randint(0, 300, (2, 30))
    with Matmuls() as with_grad:
        ref, n_ref = chunked_cross_entropy(h, head, y, chunk=8)
    with torch.no_grad(), Matmuls() as without:
        loss, n = chunked_cross_entropy(h, head, y, chunk=8)
    chunks = 60 // 8 + 1
    assert n == n_ref == 60 and without.n == chunks and with_grad.n == chunks * (3 if head_trains else 2)
    torch.testing.assert_close(loss, ref.detach())
    assert not loss.requires_grad


def test_wrapped_head_falls_back_and_matches() -> None:
    torch.manual_seed(0)
    h = torch.randn(2, 10, 8, requires_grad=True)
    head = nn.Sequential(nn.Linear(8, 50, bias=True))  # not a plain bias-free Linear: checkpointed path
    y = torch.randint(0, 50, (2, 10))
    loss, _ = chunked_cross_entropy(h, head, y, chunk=3)
    ref, _ = plain_cross_entropy(head(h), y)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_no_targets_keeps_graph() -> None:
    """A micro-batch without targets (a sequence-parallel rank's prompt-only slice) reaches every parameter the
    loss would, with zero gradients: a trained head's too, or DDP/FSDP2 fall out of step with the other ranks.
    A frozen head stays out of the graph."""
    h = torch.randn(1, 4, 8, requires_grad=True)
    head = nn.Linear(8, 10, bias=True)
    loss, n = chunked_cross_entropy(h, head, torch.full((1, 4), IGNORE))
    loss.backward()
    assert n == 0 and float(loss) == 0.0 and h.grad is not None and not h.grad.any()
    assert head.weight.grad is not None and head.bias.grad is not None
    assert not head.weight.grad.any() and not head.bias.grad.any()
    frozen = nn.Linear(8, 10, bias=False).requires_grad_(False)
    loss, _ = chunked_cross_entropy(h, frozen, torch.full((1, 4), IGNORE))
    assert loss.grad_fn is not None and frozen.weight.grad is None
    from shardfit.train.preference import sequence_logps

    head.zero_grad(set_to_none=True)
    sums, counts = sequence_logps(h, head, torch.full((1, 4), IGNORE), torch.zeros(1, 4, dtype=torch.long), 1, 2)
    sums.sum().backward()
    assert sums.tolist() == counts.tolist() == [0.0] and head.weight.grad is not None


def _examples(tokenizer, n: int = 6):
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:n]]
    rows.append({"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"},
                                   {"from": "human", "value": "How are you?"}, {"from": "gpt", "value": "Fine."}]})
    return [encode_messages(tokenizer, to_messages(r, detect_format(r)), 256) for r in rows]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked(tiny_llama, tokenizer, attn: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    module = CausalLMLoss(model, chunk=64)
    examples = _examples(tokenizer)
    packed, single = pack(examples, 256), no_pack(examples)
    assert len(packed) < len(single)

    def total(rows, batch):
        s, n = 0.0, 0
        for i in range(0, len(rows), batch):
            b = collate(rows[i:i + batch], tokenizer.pad_token_id)
            loss, k = module(b.input_ids, b.position_ids, b.targets)
            s, n = s + float(loss), n + k
        return s, n

    s_packed, n_packed = total(packed, 2)
    s_single, n_single = total(single, 1)
    s_padded, n_padded = total(single, 3)  # unpacked but right-padded batches
    assert n_packed == n_single == n_padded
    assert s_packed == pytest.approx(s_single, rel=1e-5)
    assert s_padded == pytest.approx(s_single, rel=1e-5)
