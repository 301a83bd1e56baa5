"""No host syncs in a training step: the ops that would make a GPU's host wait for the device, counted on a CPU
with the GPU code path on (tests/host_syncs.py), and the replacements giving the same numbers as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardfit.config import load_config
from shardfit.data.loader import StepRows, collate
from shardfit.data.packing import pack
from shardfit.data.tokenize import IGNORE
from shardfit.models.build import use_attention
from shardfit.parallel.env import init_distributed
from shardfit.train.diverge import DivergenceStop
from shardfit.train.loss import CausalLMLoss, chunked_cross_entropy
from shardfit.train.metrics import MetricsLog, StepLogger
from shardfit.train.recipe import FineTune
from tests.helpers import write_config
from tests.host_syncs import HostSyncs


def _recipe(tmp_path: Path, model: Path, data: Path, method: str) -> FineTune:
    """A set-up fine-tune of a tiny model, its divergence stop on the device as on a GPU."""
    cfg = write_config(tmp_path / "c.yaml", model=str(model), data=str(data), output_dir=str(tmp_path / "run"),
                       method=method, precision="fp32", max_seq_len=256, micro_batch=4, grad_accum=2, max_steps=4,
                       lora={"rank": 4, "alpha": 8}, attn_implementation="sdpa")
    recipe = FineTune(load_config(cfg), init_distributed(), quiet=True)
    recipe.setup()
    recipe.stop = DivergenceStop(recipe.optimizer, recipe.env.device, on_device=True)
    recipe.logger = StepLogger(MetricsLog(recipe.run_dir, recipe.env), recipe.env, 100, recipe.total_steps, 0,
                               recipe.batches.epoch_of, 0.0, show=False)
    return recipe


def _packed(recipe: FineTune) -> StepRows:
    """Two micro-batches of packed rows (every row restarts its positions)."""
    ex = recipe.train_examples
    micro = [pack(ex[k:k + 4], 256) for k in (0, 4)]
    assert all(len(m) < 4 for m in micro)
    return StepRows(micro, sum(e.n_targets for e in ex[:8]), sum(len(e.input_ids) for e in ex[:8]), 8)


def _syncs(recipe: FineTune, rows: StepRows) -> HostSyncs:
    recipe.train_step(0, rows)  # warm-up: first-use initialisation stays out of the count
    with HostSyncs() as syncs:
        recipe.train_step(1, rows)
    return syncs


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_training_step_never_waits_for_the_device(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                                    method: str) -> None:
    """Budget: 0 per micro-batch and 0 per step, unpacked and packed rows (2 micro-batches a step)."""
    recipe = _recipe(tmp_path, tiny_qwen2, small_data, method)
    plain = recipe.batches.step(0)
    for rows in (plain, _packed(recipe)):
        syncs = _syncs(recipe, rows)
        assert syncs.total == 0, dict(syncs.where)


def test_the_remaining_wait_is_transformers_own_on_decoders_without_a_mask_mapping(
        tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    """Llama's decoder takes no {layer type: mask} mapping: on rows without a restart transformers still reads the
    positions back once per micro-batch (nothing else does); packed rows get their mask without it."""
    recipe = _recipe(tmp_path, tiny_llama, small_data, "lora")
    syncs = _syncs(recipe, recipe.batches.step(0))
    assert dict(syncs.where) == {next(iter(syncs.where)): 2} and "find_packed_sequence_indices" in str(syncs.where)
    assert _syncs(recipe, _packed(recipe)).total == 0


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_the_host_facts_change_no_number(arch: str, kernel: str, request: pytest.FixtureRequest,
                                         small_data: Path, tokenizer) -> None:
    """The loss and every gradient are bit-equal with the host's counts and mask argument and without them, on
    packed rows and on plain ones."""
    from transformers import AutoModelForCausalLM

    from tests.test_loss import _examples

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(arch))
    use_attention(model, kernel)
    module = CausalLMLoss(model, chunk=16)
    examples = _examples(tokenizer)
    for rows in (pack(examples, 256), [pack([e], 256)[0] for e in examples]):
        batch = collate(rows, tokenizer.pad_token_id)
        results = []
        for facts in ({}, batch.host_facts):
            model.zero_grad(set_to_none=True)
            loss, n = module(batch.input_ids, batch.position_ids, batch.targets, **facts)
            loss.backward()
            results.append((loss.detach(), n, [p.grad.clone() for p in model.parameters()]))
        (ref, n_ref, g_ref), (got, n_got, g_got) = results
        assert n_got == n_ref == batch.n_targets and torch.equal(got, ref)
        assert all(torch.equal(a, b) for a, b in zip(g_got, g_ref, strict=True))


@pytest.mark.parametrize("head_trains", [False, True])
def test_the_index_selection_equals_the_mask_selection_bit_for_bit(head_trains: bool) -> None:
    torch.manual_seed(0)
    h = torch.randn(3, 40, 24, requires_grad=True)
    head = nn.Linear(24, 500, bias=False).requires_grad_(head_trains)
    y = torch.randint(0, 500, (3, 40))
    y[:, :15] = IGNORE
    y[1, 30:] = IGNORE
    keep = y != IGNORE
    grads = []
    for run in ("mask", "index"):
        h.grad, head.weight.grad = None, None
        if run == "mask":  # the selection before: a boolean mask (a wait for the device, forward and backward)
            loss, n = chunked_cross_entropy(h[keep][None], head, y[keep][None], chunk=7)
        else:
            loss, n = chunked_cross_entropy(h, head, y, chunk=7, n_targets=int(keep.sum()))
        loss.backward()
        grads.append((loss.detach(), n, h.grad.clone(), head.weight.grad.clone() if head_trains else None))
    (l0, n0, gh0, gw0), (l1, n1, gh1, gw1) = grads
    assert n0 == n1 == 65 and torch.equal(l0, l1) and torch.equal(gh0, gh1)
    assert not head_trains or torch.equal(gw0, gw1)


def test_the_stop_on_the_device_applies_no_update_from_the_first_bad_step() -> None:
    p = nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([p], lr=0.1, fused=True)
    stop = DivergenceStop(optimizer, torch.device("cpu"), on_device=True)

    def step(k: int, grad: float) -> None:
        p.grad = torch.full((4,), grad)
        with HostSyncs() as syncs:
            assert stop.observe(k, torch.linalg.vector_norm(p.grad)) is None
            optimizer.step()
        assert syncs.total == 0

    step(1, 1.0)
    good = (p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()})
    assert stop.check() is None
    step(2, float("nan"))
    step(3, 1.0)  # finite again: still no update, the weights stay those before the first bad step
    assert torch.equal(p.detach(), good[0])
    assert all(torch.equal(optimizer.state[p][k], v) for k, v in good[1].items())
    diverged = stop.check()
    assert diverged is not None and diverged.step == 2 and diverged.grad_norm != diverged.grad_norm  # nan


def test_a_mixture_of_experts_step_never_waits_for_the_device(tmp_path: Path, tokenizer_dir: Path,
                                                              small_data: Path) -> None:
    """Qwen3-MoE LoRA: the expert load and the load-balancing loss stay on the device until a logging step (budget:
    0 per micro-batch and per step); the logged figures are those of the window. Its decoder, like Llama's, takes
    no mask mapping: on plain rows transformers' own read of the positions is the one wait left (see above)."""
    from tests.families import make_family_model

    recipe = _recipe(tmp_path, make_family_model("Qwen3-MoE", tmp_path / "moe", tokenizer_dir), small_data, "lora")
    assert recipe.routing.moe_top_k
    assert _syncs(recipe, _packed(recipe)).total == 0
    plain = _syncs(recipe, recipe.batches.step(0))
    assert [w.split()[-1] for w in plain.where] == ["find_packed_sequence_indices"] and plain.total == 2, plain.where
    recipe.logger._steps = 4  # the steps above, as end_step counts them
    record = recipe.logger._routing_record()
    assert record["aux_loss"] > 0 and 0 <= record["expert_load_min"] <= 1 <= record["expert_load_max"], record
