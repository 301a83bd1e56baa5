"""The optimizers beyond AdamW (plan/optimizer_kinds.py): each one's planned states against what the real optimizer
keeps after one step on a tiny model, their forms under ZeRO-3 and FSDP, and the CLI's choices."""

from __future__ import annotations

import dataclasses
import tempfile
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.optimization import Adafactor

from shardfit.cli.main import build_parser
from shardfit.plan.comms import ADAM_BYTES_PER_PARAM
from shardfit.plan.deepspeed import ZeroSettings, step_bytes, step_copies, zero_memory
from shardfit.plan.estimate import estimate, per_rank, state_bytes, trainable_params
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.optimizer_kinds import OPTIMIZERS
from shardfit.plan.optimizer_states import (
    factored_elements,
    foreach_temp_bytes,
    fsdp1_flat_piece,
    largest_trainable,
    loop_copy_bytes,
    step_bytes_per_param,
    step_temp_bytes,
)
from shardfit.plan.pipeline import stage_breakdown
from shardfit.plan.plan import alternatives, make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.strategy import get

GIB = 2**30
CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 500, "tie_word_embeddings": True}
# The planner's optimizer -> the real one it stands for, built over a model's parameters.
REAL = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "rmsprop_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True),
    "rmsprop_centered_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
    "adafactor_torch": lambda ps: torch.optim.Adafactor(ps, lr=1e-3),
    # as the HF Trainer's `optim: adafactor` builds it (trainer_optimizer.py `_get_adafactor`)
    "adafactor": lambda ps: Adafactor(ps, lr=1e-3, scale_parameter=False, relative_step=False),
    "adafactor_beta1": lambda ps: Adafactor(ps, lr=1e-3, scale_parameter=False, relative_step=False, beta1=0.9),
}


def _model_and_shape(dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    """A tiny Qwen2 (tied embedding, q/k/v biases) in `dtype`, and the plan's shape of it."""
    config = Qwen2Config(**CONFIG)
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype), resolve_shape(str(folder))


def _measured(model: torch.nn.Module, name: str) -> int:
    """Bytes of the state tensors `name`'s real optimizer keeps after one step: every tensor in `optimizer.state`
    but the 0-dim counters (`step`, transformers' `RMS`) torch keeps on the host."""
    opt = REAL[name](list(model.parameters()))
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize(("dtype", "over"), [(torch.float32, {}), (torch.bfloat16, {"pure_16bit": True})])
def test_planned_states_are_what_the_real_optimizer_keeps(name: str, dtype: torch.dtype, over: dict) -> None:
    """A full fine-tune of the tiny model, fp32 masters or pure bf16: the plan's optimizer part is the bytes the
    real optimizer holds after its first step (Adafactor: a row and a column per matrix, the whole of each vector;
    transformers' in fp32 even for bf16 weights, torch's in the weights' dtype)."""
    model, shape = _model_and_shape(dtype)
    w = Workload(method="full", precision="bf16", optimizer=name, **over)
    assert state_bytes(shape, w)[2] == _measured(model, name)


def test_a_7b_full_fine_tune_with_adafactor_holds_kilobytes_per_row_not_8_bytes_per_weight() -> None:
    """Llama-2-7B: Adafactor's factored states are a few MiB where AdamW's are 8 bytes a weight (50 GiB); SGD none,
    Lion one state, AdEMAMix three."""
    shape = resolve_shape("meta-llama/Llama-2-7b-hf")
    full = Workload(method="full", precision="bf16", fused_adamw=True)
    t = trainable_params(shape, full)
    states = {n: state_bytes(shape, dataclasses.replace(full, optimizer=n))[2] for n in OPTIMIZERS}
    assert states["adamw"] == 8 * t and states["sgd"] == 0 and states["lion"] == 4 * t
    assert states["ademamix"] == 12 * t and states["adafactor_beta1"] == 4 * t + states["adafactor"]
    assert 0 < states["adafactor"] < 0.001 * states["adamw"]
    assert states["adafactor"] == 4 * factored_elements(shape, full, t)


def test_zero3_partitions_are_flat_so_adafactor_keeps_its_whole_second_moment() -> None:
    """DeepSpeed steps the client optimizer on its flat fp32 partition: Adafactor sees a vector, so one fp32 state
    per weight beside the masters (not its factors), and transformers' per-tensor step copies the partition twice.
    FSDP2 keeps each shard's 2-D shape (factored, 1/8 each); FSDP1's flat parameters are vectors like ZeRO's."""
    shape, hw = resolve_shape("meta-llama/Llama-2-7b-hf"), parse_gpus("8xH100", 1, None)
    w = Workload(method="full", precision="bf16", optimizer="adafactor", fused_adamw=True)
    t = trainable_params(shape, w)
    z = ZeroSettings(stage=3)
    m = zero_memory(shape, w, 8, z)
    assert m.states == pytest.approx(4 * t / 8 + 4 * t / 8)
    part = z.sub_group_size + largest_trainable(shape, w) / 8
    assert step_bytes(shape, w, 8, z, m, 0.0)[1] == pytest.approx(2 * 4 * min(t / 8, part))
    fsdp2 = per_rank(shape, w, hw, get("zero3"))
    assert fsdp2.optimizer == pytest.approx(state_bytes(shape, w)[2] / 8)
    assert fsdp2.optimizer < 0.01 * GIB
    fsdp1 = per_rank(shape, dataclasses.replace(w, fsdp1=True), hw, get("zero3"))
    assert fsdp1.optimizer == pytest.approx(4 * t / 8)


def test_step_copies_follow_each_kernel() -> None:
    """Multi-tensor steps: AdamW and RMSprop one copy of the group, Adagrad two (`std`, `numerator`), SGD none;
    bitsandbytes' Lion none; transformers' Adafactor loops over tensors: two fp32 copies of the largest, two more
    where the weights are 16-bit."""
    params, largest = 1e6, 1e4
    full = Workload(method="full", precision="bf16")
    copies = {n: foreach_temp_bytes(params, dataclasses.replace(full, optimizer=n), largest) / (4 * params)
              for n in ("adamw", "rmsprop", "adagrad", "sgd", "sgd_momentum")}
    assert copies == {"adamw": 1, "rmsprop": 1, "adagrad": 2, "sgd": 0, "sgd_momentum": 0}
    lion = dataclasses.replace(full, optimizer="lion", bnb_optimizer=True, fused_adamw=True)
    assert foreach_temp_bytes(params, lion, largest) == 0
    ada = dataclasses.replace(full, optimizer="adafactor", fused_adamw=True)
    assert foreach_temp_bytes(params, ada, largest) == 2 * 4 * largest
    assert foreach_temp_bytes(params, dataclasses.replace(ada, pure_16bit=True), largest) == 4 * 4 * largest


def test_a_full_fine_tune_the_adamw_plan_does_not_fit_fits_with_adafactor() -> None:
    """Llama-2-7B full fine-tune (fp32 masters) on one 80 GiB card: with AdamW's 50 GiB of states it does not
    fit, with Adafactor's it does: its optimizer part is its factors and its step's two fp32 copies of the largest
    tensor (the 32000 x 4096 head), beside the `update` of the last block's down projection (4096 x 11008), the
    matrix the Trainer's decay group steps just before it."""
    shape, hw = resolve_shape("meta-llama/Llama-2-7b-hf"), parse_gpus("1xH100", 1, None)
    w = Workload(method="full", precision="bf16", seq_len=512, fused_adamw=True)
    assert not estimate(shape, w, hw, "single").fits
    a = dataclasses.replace(w, optimizer="adafactor")
    ada = estimate(shape, a, hw, "single")
    copies = 2 * 4 * largest_trainable(shape, a) + 4 * shape.hidden * shape.intermediate
    assert ada.fits and ada.per_gpu_gib.optimizer == pytest.approx((state_bytes(shape, a)[2] + copies) / GIB)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_plan_takes_every_modelled_optimizer(name: str) -> None:
    """`shardfit plan --optimizer` offers each optimizer the table models."""
    args = build_parser().parse_args(["plan", "--model", "Qwen/Qwen2.5-0.5B", "--optimizer", name])
    assert args.optimizer == name


def test_the_step_s_time_reads_the_bytes_each_optimizer_touches() -> None:
    """The step at the memory bandwidth (plan/comms.py): AdamW's fitted 28 bytes a weight (8-bit AdamW too); SGD
    only the weight and its gradient, Lion one state more, AdEMAMix three, Adafactor its two per-tensor copies."""
    per = {n: step_bytes_per_param(Workload(optimizer=n)) for n in ("adamw", "adamw8bit", "sgd", "lion", "ademamix",
                                                                    "adafactor")}
    assert per == {"adamw": ADAM_BYTES_PER_PARAM, "adamw8bit": 28, "sgd": 12, "lion": 20, "ademamix": 36,
                   "adafactor": 28}


class _PeakAllocated(TorchDispatchMode):
    """The most bytes of new storage the ops run under it hold at once (a storage counts until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for t in tree_flatten(out)[0]:
            ptr = t.untyped_storage().data_ptr() if torch.is_tensor(t) else 0
            if not ptr or ptr in given or ptr in self.seen:
                continue
            size = t.untyped_storage().nbytes()
            self.seen.add(ptr)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t.untyped_storage(), self._free, ptr, size)
        return out

    def _free(self, ptr: int, size: int) -> None:
        self.live -= size
        self.seen.discard(ptr)


def _step_peak(name: str, tensors: int, n: int = 100_000) -> int:
    """Peak bytes `name`'s real optimizer allocates in its second step over `tensors` fp32 vectors of `n` elements
    each (a ZeRO partition, FSDP1's flat parameters), beyond its states."""
    return _loop_step_peak(name, [{"params": [torch.nn.Parameter(torch.zeros(n)) for _ in range(tensors)]}])


@pytest.mark.parametrize("name", ["adafactor_torch", "adafactor", "adafactor_beta1"])
def test_adafactor_on_flat_tensors_copies_as_the_real_step_does(name: str) -> None:
    """On a vector torch's Adafactor keeps `grad_squared` beside `variance.clone()` and transformers' `grad**2` beside
    `update`: two copies of a ZeRO partition, which DeepSpeed hands the optimizer one per step call. FSDP1's step
    sees several flat tensors, and the previous one's `update` is still bound when the next one's are made: three."""
    w = Workload(method="full", precision="bf16", optimizer=name, fused_adamw=True)
    n = 100_000
    assert step_copies(w, ZeroSettings(stage=2)) * 4 * n == pytest.approx(_step_peak(name, 1, n), rel=0.01)
    assert foreach_temp_bytes(3 * n, w, n, flat=True) == pytest.approx(_step_peak(name, 3, n), rel=0.01)


def test_fsdp1_adafactor_copies_the_largest_flat_piece_three_times() -> None:
    """FSDP1 (flat parameters): each rank's step copies its largest flat piece (a unit's shard, or a parameter's
    view of it, never more than the parameter) three times; FSDP2 keeps each shard's shape: one copy of 1/8 of the
    largest tensor (the head), factored, beside the last down projection's 1/8 stepped before it."""
    shape, hw = resolve_shape("meta-llama/Llama-2-7b-hf"), parse_gpus("8xH100", 1, None)
    w = Workload(method="full", precision="bf16", optimizer="adafactor_torch", fused_adamw=True)
    piece = fsdp1_flat_piece(shape, w, 8)
    assert piece == (shape.embed_params() + shape.hidden) / 8  # the root unit: the embedding and the head
    fsdp1 = per_rank(shape, dataclasses.replace(w, fsdp1=True), hw, get("zero3"))
    assert fsdp1.foreach == pytest.approx(3 * 4 * piece)
    fsdp2 = per_rank(shape, w, hw, get("zero3"))
    assert fsdp2.foreach == pytest.approx(4 * (largest_trainable(shape, w) + shape.hidden * shape.intermediate) / 8)


@pytest.mark.parametrize("name", ["adafactor", "adafactor_torch"])
def test_a_middle_pipeline_stage_sizes_adafactor_s_copies_on_its_own_largest_weight(name: str) -> None:
    """A pipeline's middle stage holds neither the embedding nor the head: Adafactor's per-tensor step copies the
    stage's largest decoder weights (Llama-2-7B's MLP, 4096 x 11008, its up projection stepped right after its
    gate), beside a few MiB of factored states; the first stage the whole model's most (the head's, 32000 x 4096,
    after the last down projection: the end stages are not told apart, an over-estimate of the first by one
    down projection's update)."""
    shape, hw = resolve_shape("meta-llama/Llama-2-7b-hf"), parse_gpus("4xH100", 1, None)
    w = Workload(method="full", precision="bf16", optimizer=name, fused_adamw=True)
    first, middle = (stage_breakdown(shape, w, hw, 4, s, 8).optimizer * GIB for s in (0, 1))
    mlp = shape.hidden * shape.intermediate
    own = foreach_temp_bytes(0, w, mlp, before=mlp)
    assert 0 < middle - own < 0.01 * GIB
    whole = foreach_temp_bytes(0, w, shape.vocab * shape.hidden, before=mlp)
    assert whole == step_temp_bytes(shape, w, 0)
    assert first - whole == pytest.approx(middle - own, abs=0.01 * GIB)


def _trainer_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The trained parameters in the HF Trainer's two param groups (Trainer.create_optimizer): matrices (decay) in
    the model's order, then the norms and biases."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trained if p.dim() > 1]}, {"params": [p for p in trained if p.dim() <= 1]}]


def _loop_step_peak(name: str, groups: list[dict[str, Any]]) -> int:
    """Peak bytes `name`'s real optimizer allocates in its second step over `groups`, beyond its states."""
    opt = REAL[name](groups)
    params = [p for g in groups for p in g["params"]]
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        with _PeakAllocated() as tracked:
            opt.step()
    return tracked.peak


@pytest.mark.parametrize("name", ["adafactor_torch", "adafactor", "adafactor_beta1"])
@pytest.mark.parametrize(("dtype", "over"), [(torch.float32, {}), (torch.bfloat16, {"pure_16bit": True})])
def test_adafactor_on_a_model_s_own_tensors_peaks_as_the_real_step_does(name: str, dtype: torch.dtype,
                                                                        over: dict) -> None:
    """The tiny Qwen2's MLP weights (gate, up, down: 512 x 256 each, its largest) are stepped one after another:
    torch's Adafactor still holds the previous one's `var_estimate` when it makes the next (2.0 copies, not 1.0),
    transformers' its `update` beside the next one's two (3.0 fp32 copies, 5.0 with the 16-bit weights' upcasts);
    with beta1 nothing of a tensor outlives its step (2.0)."""
    model, shape = _model_and_shape(dtype)
    w = Workload(method="full", precision="bf16", optimizer=name, fused_adamw=True, **over)
    planned = per_rank(shape, w, parse_gpus("1xH100", 1, None), get("single")).foreach
    assert planned == pytest.approx(_loop_step_peak(name, _trainer_groups(model)), rel=0.01)


@pytest.mark.parametrize("name", ["adafactor_torch", "adafactor", "adafactor_beta1"])
@pytest.mark.parametrize("sizes", [[256, 2048, 1024, 256], [2048, 256, 256], [256, 256, 2048], [1024, 1024, 1024]])
def test_adafactor_s_step_is_the_most_of_each_tensor_after_the_one_before(name: str, sizes: list[int]) -> None:
    """Matrices of `sizes` rows (x 256) stepped in that order: the real step's peak is the most, over each tensor,
    of its copies and those the step still holds of the one before (torch's: 1.5x the largest followed by one half
    its size, 1.0x between small ones)."""
    w = Workload(method="full", precision="bf16", optimizer=name, fused_adamw=True)
    n = [rows * 256 for rows in sizes]
    planned = max(loop_copy_bytes(w, x, before) for x, before in zip(n, [0, *n[:-1]], strict=True))
    params = [torch.nn.Parameter(torch.zeros(rows, 256)) for rows in sizes]
    assert planned == pytest.approx(_loop_step_peak(name, [{"params": params}]), rel=0.02)


@pytest.mark.parametrize("name", ["adafactor_torch", "adafactor"])
def test_peft_s_trained_embedding_copy_sizes_adafactor_s_step(name: str) -> None:
    """LoRA with peft's modules_to_save=["embed_tokens"]: the trained copy of the tiny Qwen2's embedding (500 x
    256) is the largest trainable tensor, not an adapter matrix, and Adafactor's per-tensor step copies it as the
    real step does."""
    from peft import LoraConfig, get_peft_model

    model, shape = _model_and_shape(torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                  modules_to_save=["embed_tokens"]))
    w = Workload(method="lora", precision="bf16", lora_rank=8, lora_targets=("q", "v"), optimizer=name,
                 fused_adamw=True, lora_saved=("embed",), lora_saved_dtype="trainable")
    assert largest_trainable(shape, w) == CONFIG["vocab_size"] * CONFIG["hidden_size"]
    planned = per_rank(shape, w, parse_gpus("1xH100", 1, None), get("single")).foreach
    assert planned == pytest.approx(_loop_step_peak(name, _trainer_groups(peft_model)), rel=0.05)


def test_largest_trainable_is_a_mixture_s_fused_expert_stack_and_freeze_s_block_weight() -> None:
    """transformers 5 keeps a mixture's routed experts as two 3-D parameters per block (Mixtral's gate_up_proj:
    experts x 2 intermediate x hidden), each one tensor to an optimizer (`fused_experts` off, transformers 4: an
    expert's own, as the shape counts them); freeze trains its blocks' weights, not adapter matrices."""
    mixtral = resolve_shape("mistralai/Mixtral-8x7B-v0.1")
    full = Workload(method="full", precision="bf16", optimizer="adafactor_torch", fused_adamw=True)
    assert largest_trainable(mixtral, full) == mixtral.experts * 2 * mixtral.expert_width * mixtral.hidden
    per_expert = dataclasses.replace(full, fused_experts=False)
    assert largest_trainable(mixtral, per_expert, matrices=False) == 2 * mixtral.expert_width * mixtral.hidden
    llama = resolve_shape("meta-llama/Llama-2-7b-hf")
    freeze = Workload(method="freeze", precision="bf16", optimizer="adafactor", fused_adamw=True)
    assert largest_trainable(llama, freeze) == llama.hidden * llama.intermediate


@pytest.mark.parametrize("name", ["adafactor_torch", "adafactor", "adafactor_beta1"])
def test_adafactor_steps_a_mixture_s_expert_stacks_whole(name: str) -> None:
    """A tiny Mixtral (4 experts): Adafactor's per-tensor step copies each fused expert stack whole (4 x 512 x 64,
    then 4 x 64 x 256 right after it), as the real step does."""
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=True)
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    torch.manual_seed(0)
    model, shape = AutoModelForCausalLM.from_config(config), resolve_shape(str(folder))
    w = Workload(method="full", precision="bf16", optimizer=name, fused_adamw=True)
    planned = per_rank(shape, w, parse_gpus("1xH100", 1, None), get("single")).foreach
    assert planned == pytest.approx(_loop_step_peak(name, _trainer_groups(model)), rel=0.02)


@pytest.mark.parametrize(("optimizer", "offered"), [
    ("adamw", "8-bit AdamW"), ("rmsprop", "8-bit RMSprop"), ("ademamix", "8-bit AdEMAMix"), ("lion", "8-bit Lion"),
    ("rmsprop_momentum", None), ("adagrad", None)])
def test_nothing_fits_offers_the_8bit_form_of_the_job_s_own_optimizer(optimizer: str, offered: str | None) -> None:
    """A pure-bf16 Llama-2-7B full fine-tune on one 48 GB card fits with none of these optimizers' full-width states
    (bitsandbytes' fp32 ones for Lion and AdEMAMix): bitsandbytes' 8-bit form of the job's own optimizer is offered
    under its name where the table models one, and never another optimizer (RMSprop with momentum and Adagrad have
    none: no optimizer change)."""
    shape, hw = resolve_shape("meta-llama/Llama-2-7b-hf"), parse_gpus("1x48GB", 1, None)
    w = Workload(method="full", precision="bf16", seq_len=512, optimizer=optimizer, pure_16bit=True,
                 bnb_optimizer=optimizer in ("lion", "ademamix"))
    assert make_plan(shape, w, hw).recommended is None
    changed = [a for a in alternatives(shape, w, hw) if "optimizer" in dict(a.changes)]
    if offered is None:
        assert changed == []
    else:
        assert [(a.what, dict(a.changes)["optimizer"]) for a in changed] == [(offered, optimizer + "8bit")]


def test_a_qlora_job_is_offered_8bit_states_where_its_adapters_states_decide() -> None:
    """Llama-2-70B QLoRA at rank 64 on every linear layer: 830M adapter weights keep 6 GiB of fp32 AdamW states
    (1.6 in 8 bits), so on a 50 GB card 8-bit AdamW is what makes one GPU fit."""
    shape, hw = resolve_shape("meta-llama/Llama-2-70b-hf"), parse_gpus("1x50GB", 1, None)
    w = Workload(method="qlora", precision="bf16", seq_len=2048, lora_rank=64, fused_adamw=True,
                 lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
    assert make_plan(shape, w, hw).recommended is None
    eight = [a for a in alternatives(shape, w, hw) if dict(a.changes).get("optimizer") == "adamw8bit"]
    assert [(a.what, a.strategy) for a in eight] == [("8-bit AdamW", "single")]


def _anyprecision_kahan_step(params: list[torch.nn.Parameter], state_dtype: torch.dtype) -> int:
    """The most bytes the per-tensor ops of torchdistx's AnyPrecision AdamW step with Kahan summation hold at once
    (optimizers/anyprecision_optimizer.py: `centered_variance`, then `temp_buffer = p.detach().clone()`), its states
    in `state_dtype`, made before it as the optimizer's first step does."""
    for p in params:
        m, v, c = (torch.zeros_like(p, dtype=state_dtype) for _ in range(3))
        m.mul_(0.9).add_(p.grad, alpha=0.1)
        v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
        p._keep = (m, v, c)  # states outlive the step, as the optimizer's would
    with _PeakAllocated() as tracked:
        centered = temp = None
        for p in params:
            m, v, c = p._keep
            centered = (v.sqrt() / 0.5).add_(1e-8)
            c.addcdiv_(m, centered, value=-1e-3)
            temp = p.detach().clone()
            p.data.add_(c)
            c.add_(temp.sub_(p.data))
        del centered, temp
    return tracked.peak


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_kahan_step_counts_the_weight_s_clone_beside_narrower_states(state_dtype: torch.dtype) -> None:
    """fp32 weights, Kahan on: at `temp_buffer = p.clone()` the step holds the tensor's centered variance, its fp32
    clone and the previous tensor's clone. With bf16 states that is the most (2048x256 after 256x256: 3,407,872
    bytes, where two bf16 variance copies and the previous tensor's made 2,490,368); with fp32 states the two
    variance copies beside the previous tensor's are."""
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[state_dtype]
    w = Workload(method="full", precision="bf16", optimizer="adamw_anyprecision_kahan", fused_adamw=True,
                 optimizer_dtypes=(name,) * 3)
    small, big = torch.nn.Parameter(torch.zeros(256, 256)), torch.nn.Parameter(torch.zeros(2048, 256))
    for p in (small, big):
        p.grad = torch.randn_like(p)
    measured = _anyprecision_kahan_step([small, big], state_dtype)
    assert loop_copy_bytes(w, big.numel(), small.numel()) == pytest.approx(measured, rel=0.01)


def test_the_8bit_offer_plans_what_the_trainer_s_8bit_optim_runs() -> None:
    """Llama-3-8B full fine-tune, the Trainer's adamw_torch, 1x80GB: the offer of 8-bit AdamW is bitsandbytes' as
    the Trainer builds it (`bnb_optimizer`: fp32 states for the embedding), 79.8 GiB, not 76.8 without them; it
    then does not fit, so it is not offered, and the plan's flags say --bnb-optimizer where it is."""
    shape, hw = resolve_shape("meta-llama/Meta-Llama-3-8B"), parse_gpus("1x80GB", 1, None)
    w = Workload(method="full", precision="bf16", seq_len=512, micro_batch=1, grad_ckpt="full", tool_autocast=True)
    real = estimate(shape, dataclasses.replace(w, optimizer="adamw8bit", bnb_optimizer=True), hw, "single")
    offers = [a for a in alternatives(shape, w, hw) if "optimizer" in dict(a.changes)]
    assert not real.fits and offers == []
    roomy = parse_gpus("1x84GB", 1, None)
    offer = next(a for a in alternatives(shape, w, roomy) if "optimizer" in dict(a.changes))
    real = estimate(shape, dataclasses.replace(w, optimizer="adamw8bit", bnb_optimizer=True), roomy, offer.strategy)
    assert offer.total_gib == pytest.approx(real.per_gpu_gib.total, abs=0.05)
    assert offer.how() == "--optimizer adamw8bit --bnb-optimizer"


def test_no_8bit_offer_for_an_optimizer_planned_in_another_s_place() -> None:
    """A stand-in (GaLore planned as AdamW) or DeepSpeed's own optimizer (`no_8bit_form`): the recommender offers
    no 8-bit form, which would train with another optimizer than the job's."""
    shape, hw = resolve_shape("meta-llama/Llama-2-7b-hf"), parse_gpus("1x48GB", 1, None)
    w = Workload(method="full", precision="bf16", seq_len=512, pure_16bit=True)
    assert [dict(a.changes)["optimizer"] for a in alternatives(shape, w, hw) if "optimizer" in dict(a.changes)] \
        == ["adamw8bit"]
    marked = dataclasses.replace(w, no_8bit_form=True)
    assert not [a for a in alternatives(shape, marked, hw) if "optimizer" in dict(a.changes)]
