"""Every catalog entry says its published config.json's model_type once, in the catalog: a compact entry as its
`model_type` key, a `config` entry inside its config, a `twin` through its twin. peft's default LoRA targets are
looked up by it (foreign/targets.py `plan_peft_default`); it used to be guessed from the hub id by a second table of
regexes, which missed chatglm2-6b and deepseek-math-7b-base."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from shardfit.plan.shapes import catalog, hf_config, resolve_shape

# model_types published configs give that transformers has no class for: these models load through their own
# repository's code (trust_remote_code), so AutoConfig.for_model cannot check them.
REMOTE_CODE_TYPES = {
    "qwen": "Qwen-1_8B ... Qwen-72B (v1): QWenLMHeadModel, modeling_qwen.py in the model repository",
    "chatglm": "ChatGLM2/3-6B and the original GLM-4-9B-Chat: ChatGLMForConditionalGeneration, modeling_chatglm.py",
    "baichuan": "Baichuan2-7B/13B: BaichuanForCausalLM, modeling_baichuan.py",
}
# Compact entries that hf_config builds as another family than their own type, because transformers has no class
# of their type (REMOTE_CODE_TYPES): the built family holds the same weights (plan/shapes.py `FAMILY_CONFIGS`).
BUILT_AS = {"qwen": "qwen2", "baichuan": "llama", "chatglm": ("glm", "qwen2")}

COMPACT = sorted(k for k, e in catalog().items() if "config" not in e and "twin" not in e)
TWINS = sorted(k for k, e in catalog().items() if "twin" in e)


@pytest.mark.parametrize("model", COMPACT)
def test_each_compact_entry_has_a_type_transformers_knows_or_remote_code(model: str) -> None:
    """The type is one transformers 5.23 has a config class for, or an allow-listed remote-code type; and the
    family hf_config builds the entry as agrees with it, so the two readings of the entry cannot drift apart."""
    kind = catalog()[model].get("model_type")
    assert kind, f"{model}: no model_type"
    assert resolve_shape(model).model_type == kind
    if kind in REMOTE_CODE_TYPES:
        with pytest.raises(ValueError):
            AutoConfig.for_model(kind)
    else:
        assert AutoConfig.for_model(kind).model_type == kind
    built = hf_config(resolve_shape(model)).model_type
    assert built in ((kind,) if kind not in BUILT_AS else BUILT_AS[kind]), (model, kind, built)


@pytest.mark.parametrize("model", TWINS)
def test_a_twin_takes_its_twins_type(model: str) -> None:
    assert resolve_shape(model).model_type == resolve_shape(catalog()[model]["twin"]).model_type != ""


def test_every_catalog_id_has_a_type() -> None:
    assert not [k for k in catalog() if not resolve_shape(k).model_type]


@pytest.mark.parametrize(("model", "kind"), [
    # Unchanged from the hub-id table, where the id alone misleads: Qwen v1 is not qwen2, Qwen1.5 is, GLM-4-9B-Chat
    # is the remote-code chatglm (not transformers' glm), Yi and deepseek-llm are llama, Gemma 3 1B is text-only.
    ("Qwen/Qwen-7B", "qwen"), ("Qwen/Qwen-7B-Chat", "qwen"), ("Qwen/Qwen1.5-7B-Chat", "qwen2"),
    ("THUDM/glm-4-9b-chat", "chatglm"), ("01-ai/Yi-34B-Chat", "llama"), ("deepseek-ai/deepseek-llm-7b-base", "llama"),
    ("google/gemma-3-1b-it", "gemma3_text"), ("google/gemma-7b-it", "gemma"), ("google/gemma-2-9b-it", "gemma2"),
    ("Qwen/Qwen2.5-7B", "qwen2"), ("Qwen/Qwen2.5-Coder-7B-Instruct", "qwen2"), ("Qwen/Qwen3-8B-Base", "qwen3"),
    ("Qwen/Qwen2-VL-7B-Instruct", "qwen2_vl"), ("Qwen/Qwen2.5-Omni-3B", "qwen2_5_omni"),
    ("microsoft/Phi-3-mini-4k-instruct", "phi3"), ("mistralai/Mistral-Nemo-Base-2407", "mistral"),
    ("baichuan-inc/Baichuan2-7B-Chat", "baichuan"), ("THUDM/chatglm3-6b-base", "chatglm"),
    # The hub-id table gave these none (peft's default then planned as every linear layer); their published
    # configs say chatglm (chatglm2-6b's config.json) and llama (deepseek-math-7b-base's LlamaForCausalLM).
    ("THUDM/chatglm2-6b", "chatglm"), ("deepseek-ai/deepseek-math-7b-base", "llama"),
])
def test_the_catalog_gives_the_published_type(model: str, kind: str) -> None:
    assert resolve_shape(model).model_type == kind
