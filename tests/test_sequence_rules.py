"""sequence_parallel's refusals (resolve/sequence.py): what this version splits, and the exit-2 messages."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import Glm4vConfig, LlamaConfig, MixtralConfig, Qwen2_5OmniThinkerConfig, Qwen2Config, Qwen2VLConfig

from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.parallel import launch
from shardfit.plan.shapes import resolve_shape
from shardfit.resolve.sequence import (
    DecoderFacts,
    check_balancing,
    check_layout,
    check_model,
    facts_of_config,
    facts_of_shape,
)
from tests.families import tiny_text_config
from tests.helpers import run_here, write_config


def _cfg(**over) -> Config:
    return dataclasses.replace(Config(), sequence_parallel=2, **over)


def test_layout_accepted_for_a_multi_rank_strategy() -> None:
    check_layout(_cfg(), "zero3", 4)
    check_layout(_cfg(), "ddp", 2)
    check_layout(dataclasses.replace(Config(), sequence_parallel=1), "single", 1)  # off: nothing to check


@pytest.mark.parametrize("over,strategy,world,words", [
    ({}, "zero3", 3, "must divide the job's 3 ranks"),
    ({}, "single", 1, "must divide the job's 1 rank"),
    ({}, "model_parallel", 2, "multi-rank strategy"),
    ({"objective": "dpo"}, "zero3", 2, "objective sft only"),
    ({"attn_implementation": "flash_attention_2"}, "zero3", 2, "attn_implementation: flash_attention_2"),
    ({"compile": True}, "zero3", 2, "compile: false"),
])
def test_layout_refusals_name_the_reason_and_the_fix(over: dict, strategy: str, world: int, words: str) -> None:
    with pytest.raises(UserError, match="sequence_parallel: 2") as e:
        check_layout(_cfg(**over), strategy, world)
    assert words in str(e.value) and "sequence_parallel: 1" in str(e.value)


def test_dense_text_configs_pass_and_others_are_named() -> None:
    qwen2 = facts_of_config(Qwen2Config(num_attention_heads=4, num_key_value_heads=2))
    assert qwen2 == DecoderFacts(heads=4, kv_heads=2)  # Qwen2's sliding window is off unless use_sliding_window
    check_model(2, qwen2, "qwen2")
    check_model(4, facts_of_config(LlamaConfig(num_attention_heads=4, num_key_value_heads=1)), "llama")
    assert facts_of_config(MixtralConfig()).experts
    assert facts_of_config(Qwen2VLConfig()).multimodal and facts_of_config(Qwen2VLConfig()).split_vision
    assert facts_of_config(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1,
                                       num_hidden_layers=2)).partial_attention
    check_model(2, facts_of_config(MixtralConfig()), "mixtral")  # experts act per token (loss.py: the balancing)
    check_model(2, facts_of_config(Qwen2VLConfig()), "qwen2-vl")  # image rows split (train/media_forward.py)
    for other in (Qwen2_5OmniThinkerConfig(), Glm4vConfig()):
        with pytest.raises(UserError, match="vision or audio tower other than Qwen2-VL"):
            check_model(2, facts_of_config(other), other.model_type)
    with pytest.raises(UserError, match="vision-language mixture of experts"):
        check_model(2, DecoderFacts(heads=8, kv_heads=8, experts=True, multimodal=True, split_vision=True), "vl-moe")


@pytest.mark.parametrize("family,why", [("Qwen3-MoE", None), ("GLM-4.5", None),
                                        ("gpt-oss", "sliding-window"), ("DeepSeek-V3", "latent attention")])
def test_mixtures_split_where_their_attention_is_full(family: str, why: str | None) -> None:
    """The mixtures whose attention is ordinary pass; gpt-oss's windows (and sinks) and DeepSeek-V3's latent
    attention stay refused, with the fix."""
    facts = facts_of_config(tiny_text_config(family))
    assert facts.experts
    if why is None:
        check_model(2, facts, family)
        return
    with pytest.raises(UserError, match=why) as e:
        check_model(2, facts, family)
    assert "sequence_parallel: 1" in str(e.value)


def test_a_mixture_splits_under_every_method() -> None:
    """A mixture's rows split whatever trains it (tests/test_sequence_parallel.py runs its full fine-tune): the
    rules no longer ask for the method."""
    check_model(2, facts_of_config(tiny_text_config("Qwen3-MoE")), "m")
    check_model(2, facts_of_config(tiny_text_config("Qwen3 (dense)")), "m")


def test_a_balancing_loss_of_another_form_is_refused() -> None:
    check_balancing(2, True, "m")
    check_balancing(1, False, "m")
    with pytest.raises(UserError, match="not the Switch-Transformer form.*sequence_parallel: 1"):
        check_balancing(2, False, "m")


def test_heads_that_do_not_share_out_are_refused_with_the_divisors() -> None:
    with pytest.raises(UserError, match=r"has 12 attention heads.*\(2, 3, 4, 6, 12\)"):
        check_model(8, DecoderFacts(heads=12, kv_heads=4), "m")


@pytest.mark.slow
def test_train_refuses_before_launching(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the CLI: exit 2 with the message, before any rank starts (tiny Qwen2 has 4 heads). The refusal comes
    before the launch, so the CLI's `main` runs in this process with the launch recorded, never run."""
    launched: list[list[str]] = []
    monkeypatch.setattr(launch, "relaunch", lambda cmd, env: launched.append(cmd) or 0)
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_qwen2), data=str(small_data), precision="fp32",
                       output_dir=str(tmp_path / "run"), sequence_parallel=3, strategy="ddp")
    code, _, err = run_here(capsys, "train", str(cfg), "--nproc", "3")
    assert code == 2 and not launched, err[-2000:]
    assert "has 4 attention heads" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    # one process: a regression trains here, 2 steps at most
    write_config(cfg, model=str(tiny_qwen2), data=str(small_data), precision="fp32", output_dir=str(tmp_path / "run"),
                 sequence_parallel=2, strategy="ddp", max_steps=2)
    code, _, err = run_here(capsys, "train", str(cfg))
    assert code == 2 and "must divide the job's 1 rank" in err, err[-2000:]


def test_the_planner_shape_of_a_qwen_vl_model_passes_and_an_omni_is_refused() -> None:
    """Before loading, from the catalog's shapes: Qwen2-VL's and Qwen2.5-VL's towers pass (their image rows split),
    Qwen2.5-Omni's audio tower does not."""
    for name in ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct"):
        check_model(2, facts_of_shape(resolve_shape(name)), name)
    with pytest.raises(UserError, match="vision or audio tower other than"):
        check_model(2, facts_of_shape(resolve_shape("Qwen/Qwen2.5-Omni-7B")), "Qwen/Qwen2.5-Omni-7B")
