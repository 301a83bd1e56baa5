"""Models whose blocks mix tokens in different ways (windows beside recurrent or sparse blocks) timed block kind by
block kind (plan/token_mixers.py, plan/flops.py `softmax_groups`), checked against transformers' own classes with
torch's FLOP counter; GPT-Neo's local attention read from its own keys; a window set per block kept off the
host's masks (models/masks.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    MistralConfig,
    MistralModel,
)

from shardfit.errors import UserError
from shardfit.models.build import _attention, require_per_layer_support
from shardfit.models.masks import mask_argument
from shardfit.plan import attention_layout as rule
from shardfit.plan import flops
from shardfit.plan.config_shape import attention_layout, shape_from_config
from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.token_mixers import block_groups
from shardfit.plan.workload import Workload
from shardfit.resolve import sequence

# EleutherAI/gpt-neo-125M's config.json, as published (its sizes and the keys the planner reads).
GPT_NEO_125M = {"activation_function": "gelu_new", "architectures": ["GPTNeoForCausalLM"], "attention_dropout": 0,
                "attention_layers": ["global", "local"] * 6, "attention_types": [[["global", "local"], 6]],
                "bos_token_id": 50256, "embed_dropout": 0, "eos_token_id": 50256, "hidden_size": 768,
                "initializer_range": 0.02, "intermediate_size": None, "layer_norm_epsilon": 1e-05,
                "max_position_embeddings": 2048, "model_type": "gpt_neo", "num_heads": 12, "num_layers": 12,
                "resid_dropout": 0, "vocab_size": 50257, "window_size": 256}


def _flash(seq: int) -> Workload:
    return Workload(method="lora", grad_ckpt="full", attention="flash", seq_len=seq)


def test_each_kind_of_partial_block_keeps_its_own_span() -> None:
    """RecurrentGemma (RG-LRU blocks beside 2048-token windows), dots3_note (512-token windows beside indexed blocks
    of top-k 2048) and LFM3 (short convolutions beside 256-token windows): the rules still read one partial layout,
    and each kind of block keeps its own window or top-k for the time model."""
    gemma, dots, lfm = (rule.layout_of(CONFIG_MAPPING[t]()) for t in ("recurrent_gemma", "dots3_note", "lfm3"))
    assert (gemma.span, gemma.blocks, gemma.kinds) == (2048, 26, ("window", "recurrent"))
    assert gemma.groups == ((("recurrent",), 0, 18), (("window",), 2048, 8))
    assert dots.groups == ((("sparse",), 2048, 13), (("window",), 512, 33))
    assert lfm.groups == ((("recurrent",), 0, 13), (("window",), 256, 5))


def test_recurrent_blocks_attend_to_no_positions_beside_windows() -> None:
    """RecurrentGemma-2B's config at 32k under flash: its 8 attention blocks attend within their 2048-token window,
    its 18 RG-LRU blocks to nothing (a state as wide as lru_width, 6 FLOPs per element per token), where one
    span for every partial block timed all 26 as windows."""
    shape = shape_from_config(CONFIG_MAPPING["recurrent_gemma"]().to_dict(), "recurrent-gemma-2b")
    w = _flash(32768)
    window = 2048 - 2048 * 2048 / (2 * 32768)
    assert flops.attended_positions(w, shape) == pytest.approx(window)
    per_head = 4 * shape.heads * shape.hd
    assert flops.attention_flops_per_token(shape, w) == pytest.approx(
        (8 * window * per_head + 18 * 6 * 2560) / 26)
    # twice the sequence: only the windows' first positions grow (whole attention would double)
    longer = flops.attention_flops_per_token(shape, _flash(65536))
    assert longer - flops.attention_flops_per_token(shape, w) < 0.02 * flops.attention_flops_per_token(shape, w)


def test_sparse_blocks_are_timed_over_the_whole_row_under_every_kernel() -> None:
    """dots3_note and DeepSeek-V3.2 at 32k under flash: transformers' DSA classes support neither flash nor flex
    attention and mask the indexer's top-k over the whole row, so their indexed blocks attend to the whole prefix
    (not their top-k 2048) and score every key of the row with their indexer (64 heads of 128, forward only); the
    windowed blocks stay within 512."""
    shape = shape_from_config(CONFIG_MAPPING["dots3_note"]().to_dict(), "dots3_note")
    w = _flash(32768)

    def within(size: int) -> float:
        return size - size * size / (2 * 32768)

    assert flops.attended_positions(w, shape) == pytest.approx((13 * 16384 + 33 * within(512)) / 46)
    assert flops.indexer_flops_per_token(shape, w) == pytest.approx(13 * 2 * 64 * 128 * 32768 / 46)
    sdpa = Workload(method="lora", grad_ckpt="full", attention="sdpa", seq_len=32768)
    assert flops.attended_positions(sdpa, shape) == 32768  # transformers' dense mask over the whole row
    dsa = shape_from_config(CONFIG_MAPPING["deepseek_v32"]().to_dict(), "deepseek_v32")
    assert flops.attended_positions(w, dsa) == 16384


def _counted_growth(model_type: str, sizes: dict[str, Any], short: int = 64, long: int = 192) -> tuple[float, float]:
    """How much the forward's FLOPs per token grow from `short` to `long` tokens: counted by torch's FLOP counter on
    transformers' class built from `sizes` (eager attention, whose matmuls it counts on a CPU), and planned."""
    config = CONFIG_MAPPING[model_type](**sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()

    def counted(seq: int) -> float:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(input_ids=torch.randint(0, sizes["vocab_size"], (1, seq)))
        return counter.get_total_flops() / seq

    shape = shape_from_config({"model_type": model_type, **sizes}, model_type)

    def planned(seq: int) -> float:
        w = Workload(method="lora", grad_ckpt="none", attention="eager", seq_len=seq)
        return shape.layers * (flops.attention_flops_per_token(shape, w) + flops.indexer_flops_per_token(shape, w))

    return counted(long) - counted(short), planned(long) - planned(short)


def test_a_recurrent_hybrid_grows_with_the_sequence_only_in_its_attention_blocks() -> None:
    """A tiny RecurrentGemma (4 RG-LRU blocks, 2 attention blocks): what grows with the sequence is the attention
    blocks' QK^T and PV, as counted on transformers' model; its recurrent blocks add nothing that grows."""
    counted, planned = _counted_growth("recurrent_gemma", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, lru_width=64, vocab_size=128, attention_window_size=32))
    assert planned == pytest.approx(counted, rel=0.01)


def test_a_sparse_model_grows_with_its_attention_and_its_indexer() -> None:
    """A tiny DeepSeek-V3.2 (SDPA's and eager's dense mask over the whole row, and the indexer scoring every key): the
    growth counted on transformers' model, within the indexer's sum over its heads (left out)."""
    counted, planned = _counted_growth("deepseek_v32", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, index_topk=16, index_head_dim=16, index_n_heads=4, vocab_size=128))
    assert planned == pytest.approx(counted, rel=0.02)


def test_gpt_neo_local_blocks_are_windows_on_both_sides() -> None:
    """GPT-Neo names its local blocks in `attention_layers` and their window `window_size`: the rank's rule reads
    them as windows (refused for sequence parallelism), and the planner reads its published config.json (heads
    under `num_heads`, layers under `num_layers`) to the same layout and within 2 % of the weights of
    transformers' model (its learned positions and biases left out)."""
    built = GPTNeoConfig(**{k: v for k, v in GPT_NEO_125M.items() if k != "model_type"})
    assert rule.layout_of(GPTNeoConfig()) == rule.AttentionLayout(256, 12, ("window",))
    local = rule.AttentionLayout(256, 6, ("window",))
    assert attention_layout(GPT_NEO_125M, "gpt-neo") == rule.layout_of(built) == local
    with pytest.raises(UserError, match="sliding-window attention layers"):
        sequence.check_model(2, sequence.facts_of_config(built), "gpt-neo")
    shape = shape_from_config(GPT_NEO_125M, "gpt-neo-125M")
    assert (shape.heads, shape.layers, shape.sliding_window, shape.sliding_layers, shape.tied) == (12, 12, 256, 6, True)
    with torch.device("meta"):
        weights = sum(p.numel() for p in GPTNeoForCausalLM(built).parameters())
    assert shape.params() == pytest.approx(weights, rel=0.02)


def test_a_window_set_per_block_leaves_the_mask_to_transformers() -> None:
    """A Mistral whose per_layer_config gives one block its own window: reading its window globally raises in
    transformers; the host's mask argument leaves it to transformers under every kernel instead."""
    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=100, sliding_window=8,
                           per_layer_config={"1": {"sliding_window": 4}})
    model = MistralModel(config)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    for kernel in ("sdpa", "eager", "flex_attention"):
        model.config._attn_implementation = kernel
        assert mask_argument(model, positions, True) == {}


def test_a_mamba_block_is_timed_by_its_state() -> None:
    """A tiny Jamba (one Mamba block, one attention block): its scan updates as many state elements per token as
    transformers' Mamba mixer holds in A_log (channels x state size), 6 FLOPs each; Zamba2's hybrid blocks run
    attention over the whole row beside their Mamba state."""
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, attn_layer_period=2, attn_layer_offset=1,
                 expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_expand=2,
                 mamba_dt_rank=8)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["jamba"](**sizes))
    (state,) = [p.numel() for name, p in model.named_parameters() if name.endswith("A_log")]
    (group,) = shape_from_config({"model_type": "jamba", **sizes}, "jamba").attention_groups
    assert (group.blocks, group.attention, group.recurrence) == (1, "none", 6 * state)
    assert rule.layout_of(CONFIG_MAPPING["zamba2"]()).groups == ((("recurrent",), 0, 45), (("recurrent", "full"), 0, 9))


def test_compressed_sparse_blocks_are_timed_whole_without_an_indexer_over_the_row() -> None:
    """DeepSeek-V4's compressed sparse blocks attend to compressed keys, not a top-k of the row's, and its indexer
    scores compressed entries: timed as whole attention (as before), with no indexer over the row."""
    shape = shape_from_config(CONFIG_MAPPING["deepseek_v4"]().to_dict(), "deepseek_v4")
    assert [(g.blocks, g.attention, g.index) for g in shape.attention_groups] == [(shape.layers, "full", 0)]
    assert flops.attended_positions(_flash(8192), shape) == 4096


def test_gpt_neo_is_planned_as_eager_and_whole_under_flash() -> None:
    """GPT-Neo's class has no SDPA: its default and `sdpa` plans are its eager plan (the rank loads `auto` as eager
    by the same rule, and refuses `sdpa` naming eager), and its flash class passes no window, so its local blocks
    attend to the whole row there."""
    shape = shape_from_config(GPT_NEO_125M, "gpt-neo-125M")
    hw = parse_gpus("1x80GB")
    sdpa, eager = (Workload(method="lora", seq_len=2048, attention=a) for a in ("sdpa", "eager"))
    planned = make_plan(shape, sdpa, hw, ("single",))
    assert planned.workload.attention == "eager" and any("runs eager" in n for n in planned.notes)
    as_eager = make_plan(shape, eager, hw, ("single",)).candidates[0]
    assert (planned.candidates[0].per_gpu_gib, planned.candidates[0].step_s) == (as_eager.per_gpu_gib, as_eager.step_s)
    assert estimate(shape, sdpa, hw, "single").per_gpu_gib == as_eager.per_gpu_gib
    assert flops.attended_positions(_flash(2048), shape) == 1024
    config = GPTNeoConfig(**{k: v for k, v in GPT_NEO_125M.items() if k != "model_type"})
    assert _attention(SimpleNamespace(attn_implementation="auto"), config) == {"attn_implementation": "eager"}
    with pytest.raises(UserError, match="attn_implementation: eager"):
        _attention(SimpleNamespace(attn_implementation="sdpa"), config)


def test_unknown_recurrent_blocks_get_no_made_up_state() -> None:
    """Inkling's and ZAYA's hybrid blocks (attention beside short convolutions or CCA, no key-by-value state) are
    timed as the attention their layout states, with no state update; MiniMax's lightning attention keeps its
    heads x head_dim^2 state; a recurrent layer type of a family without a known state is timed as attention."""
    for model_type in ("inkling_text", "zaya"):
        shape = shape_from_config(CONFIG_MAPPING[model_type]().to_dict(), model_type)
        assert [g.recurrence for g in shape.attention_groups] == [0.0] * len(shape.attention_groups), model_type
    minimax = shape_from_config(CONFIG_MAPPING["minimax"]().to_dict(), "minimax")
    assert any(g.recurrence == 6 * minimax.heads * minimax.hd ** 2 for g in minimax.attention_groups)
    (group,) = block_groups(rule.AttentionLayout(1, 2, ("recurrent",), ((("recurrent",), 0, 2),)),
                            {"model_type": "unknown"}.get, lambda key: False, name="m", hidden=64, heads=4,
                            head_dim=16, deltanet=False)
    assert (group.attention, group.recurrence) == ("full", 0.0)


@pytest.mark.parametrize(("model_type", "keys", "named"), [
    ("deepseek_v32", {"index_topk": 0}, "index_topk"),
    ("deepseek_v32", {"index_topk": -4}, "index_topk"),
    ("bamba", {"mamba_d_state": None}, "mamba_d_state"),
    ("gpt_neo", {"window_size": -1}, "window_size"),
    ("gpt_neo", {"attention_types": [[["global", "weird"], 12]]}, "attention_layers"),
])
def test_odd_settings_are_refused_naming_the_key(model_type: str, keys: dict[str, Any], named: str) -> None:
    """Settings transformers' config class accepts but whose blocks cannot run (an indexer picking no keys, a state
    size of null, a window that is not a size, a block name GPT-Neo raises on) exit 2 naming the key."""
    config = {**CONFIG_MAPPING[model_type]().to_dict(), **keys}
    config.pop("attention_layers", None) if "attention_types" in keys else None
    with pytest.raises(UserError, match=named):
        shape_from_config(config, model_type)


def test_a_per_layer_value_its_class_reads_globally_is_refused() -> None:
    """A Mistral whose per_layer_config gives one block its own window: transformers builds it and its first forward
    raises; shardfit refuses it before building, naming the block's key (exit 2, not an unexpected error)."""
    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=100, sliding_window=8,
                           per_layer_config={"1": {"sliding_window": 4}})
    cfg = SimpleNamespace(model="tiny", attn_implementation="auto", trust_remote_code=False)
    with pytest.raises(UserError, match=r"per_layer_config\.1\.sliding_window"):
        require_per_layer_support(config, torch.float32, cfg)
    require_per_layer_support(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=100),
                              torch.float32, cfg)
