"""What each tool does to a QLoRA job's dtypes after loading (foreign/kbit.py): axolotl casts the embeddings, norms
and head back to the compute dtype after prepare_model_for_kbit_training (fp32 stays only on the expert stacks
bitsandbytes leaves unquantized), TRL 1.16's trainers skip the preparation and cast every trainable parameter to
bf16, and ms-swift computes 4-bit layers in fp32 under a float16 or float32 torch_dtype unless
--bnb_4bit_compute_dtype says otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job

AXOLOTL = ("base_model: {model}\nadapter: qlora\nload_in_4bit: true\nsequence_len: 2048\nbf16: true\n"
           "lora_target_linear: true\n{extra}")


def _axolotl(tmp_path: Path, extra: str = "", model: str = "meta-llama/Llama-3.1-8B", version: str = "5.23.0"):
    path = tmp_path / "job.yml"
    path.write_text(AXOLOTL.format(model=model, extra=extra))
    return read_job("axolotl", str(path), JobOptions(transformers=version))


def test_axolotl_casts_embeddings_norms_and_head_back(tmp_path: Path) -> None:
    """A dense model's QLoRA: after prepare_model_for_kbit_training axolotl casts every non-4-bit weight it names
    back to bf16, so nothing frozen stays fp32, and the note says so."""
    job = _axolotl(tmp_path)
    assert not job.workload.frozen_fp32
    assert any("axolotl casts the embeddings, norms and head back to bf16" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("version", "extra", "fp32"), [("5.2", "", True), ("4.57", "", False),
                                                        ("5.2", "quantize_moe_experts: true\n", False)])
def test_axolotl_keeps_fp32_only_on_unquantized_experts(tmp_path: Path, version: str, extra: str,
                                                        fp32: bool) -> None:
    """A mixture under transformers 5: the fused expert stacks bitsandbytes leaves alone stay fp32 after the
    preparation (axolotl's cast back does not name them); NF4 experts (transformers 4, quantize_moe_experts) leave
    nothing fp32."""
    job = _axolotl(tmp_path, extra, "Qwen/Qwen3-30B-A3B", version)
    assert job.workload.frozen_fp32 is fp32
    assert any("routed experts bitsandbytes leaves unquantized stay fp32" in n for n in job.notes) is fp32


def test_axolotl_qlora_fsdp_skips_the_preparation(tmp_path: Path) -> None:
    job = _axolotl(tmp_path, "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\n",
                   "Qwen/Qwen3-30B-A3B", "5.2")
    assert not job.workload.frozen_fp32
    assert any("skips prepare_model_for_kbit_training" in n for n in job.notes), job.notes


SCRIPT = ("import torch\nfrom transformers import AutoModelForCausalLM, BitsAndBytesConfig\n"
          "from peft import LoraConfig{imports}\nfrom trl import SFTConfig, SFTTrainer\n"
          "q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)\n"
          "model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', quantization_config=q)\n{prepare}"
          "args = SFTConfig(output_dir='o', per_device_train_batch_size=1, max_length=1024, bf16=True)\n"
          "SFTTrainer(model=model, args=args, peft_config=LoraConfig(r=16, lora_alpha=32)).train()\n")


def _hf(tmp_path: Path, script: str, command: str = "python train.py --model_name_or_path Qwen/Qwen2.5-0.5B\n"):
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "run.sh").write_text(command)
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_trl_sft_casts_trainables_to_bf16_without_preparing(tmp_path: Path) -> None:
    """TRL 1.16's SFTTrainer on a 4-bit model: no prepare_model_for_kbit_training (frozen weights as loaded), and
    every trainable parameter in bf16 (adapters, saved copies); the note names the version."""
    w = (job := _hf(tmp_path, SCRIPT.format(imports="", prepare=""))).workload
    assert w.method == "qlora" and not w.frozen_fp32 and w.adapters_16bit and w.lora_saved_dtype == "trainable"
    assert any("trl 1.16" in n and "SFT since 0.26" in n for n in job.notes), job.notes


def test_a_script_that_prepares_the_model_itself_keeps_fp32_frozen_weights(tmp_path: Path) -> None:
    script = SCRIPT.format(imports=", prepare_model_for_kbit_training",
                           prepare="model = prepare_model_for_kbit_training(model)\n")
    w = _hf(tmp_path, script).workload
    assert w.frozen_fp32 and w.adapters_16bit


@pytest.mark.parametrize(("flags", "fp32"), [("", True), ("--dtype bfloat16", False), ("--dtype auto", False)])
def test_trl_cli_loads_in_its_model_config_dtype(tmp_path: Path, flags: str, fp32: bool) -> None:
    """`trl sft --use_peft --load_in_4bit`: ModelConfig loads the model, and sets the 4-bit compute dtype, in
    --dtype, float32 by default; the adapters are bf16 either way."""
    (tmp_path / "run.sh").write_text(f"trl sft --model_name_or_path Qwen/Qwen2.5-0.5B --use_peft --load_in_4bit "
                                     f"--max_length 1024 {flags}\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    w = job.workload
    assert w.frozen_fp32 is fp32 and w.bnb_compute_fp32 is fp32 and w.adapters_16bit
    assert "dtype" not in job.not_modelled


def test_trl_cli_refuses_a_dtype_model_config_does_not_take(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text("trl sft --model_name_or_path Qwen/Qwen2.5-0.5B --use_peft --load_in_4bit "
                                     "--dtype fp8\n")
    with pytest.raises(UserError, match=r"--dtype fp8: TRL's ModelConfig takes auto, bfloat16, float16, float32"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_a_plain_trainer_script_keeps_its_preparation(tmp_path: Path) -> None:
    """No TRL trainer (Qwen's finetune.py and its --q_lora): the script prepares the model, as read before."""
    job = _hf(tmp_path, "from transformers import Trainer\n", "python train.py --model_name_or_path "
              "Qwen/Qwen2.5-0.5B --q_lora True --use_lora True --bf16 True\n")
    assert job.workload.frozen_fp32 and not job.workload.adapters_16bit


SWIFT = "swift sft --model Qwen/Qwen2.5-7B-Instruct --train_type lora --quant_bits 4 --quant_method bnb {flags}\n"


@pytest.mark.parametrize(("flags", "fp32"), [
    ("--torch_dtype float16", True), ("--torch_dtype float32", True), ("--torch_dtype bfloat16", False),
    ("--torch_dtype float16 --bnb_4bit_compute_dtype bfloat16", False),
    ("--torch_dtype bfloat16 --bnb_4bit_compute_dtype float32", True)])
def test_swift_4bit_compute_dtype(tmp_path: Path, flags: str, fp32: bool) -> None:
    """ms-swift's compute dtype: --bnb_4bit_compute_dtype, else bfloat16 under a bfloat16 torch_dtype and fp32
    under float16 or float32 (quant_args.py `__post_init__`); bitsandbytes' kernels either way."""
    (tmp_path / "run.sh").write_text(SWIFT.format(flags=flags))
    job = read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.bnb_compute_fp32 is fp32 and job.workload.quant_backend == "bnb"
    assert not {"bnb_4bit_compute_dtype", "quant_method"} & set(job.not_modelled)


def test_swift_refuses_a_compute_dtype_it_does_not_take(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text(SWIFT.format(flags="--bnb_4bit_compute_dtype int8"))
    with pytest.raises(UserError, match=r"--bnb_4bit_compute_dtype int8: ms-swift takes float16, bfloat16, "
                                        r"float32"):
        read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_trl_orpo_prepares_then_casts_embeddings_and_head_back(tmp_path: Path) -> None:
    """TRL 1.16's experimental ORPO trainer still calls peft's preparation, then under bf16 casts the embeddings and
    head back (peft_module_casting_to_bf16): a dense model keeps no fp32 frozen weights, and fp32 adapters."""
    script = SCRIPT.format(imports="", prepare="").replace("SFTConfig, SFTTrainer", "ORPOConfig, ORPOTrainer").replace(
        "SFTConfig(", "ORPOConfig(").replace("SFTTrainer(", "ORPOTrainer(")
    job = _hf(tmp_path, script)
    assert not job.workload.frozen_fp32 and not job.workload.adapters_16bit
    assert any("ORPOTrainer" in n and "norms stay fp32" in n for n in job.notes), job.notes


def test_frozen_fp32_on_a_trl_kbit_job_plans_older_trl_whole(tmp_path: Path) -> None:
    """The TRL note's advice for older TRL (--frozen-fp32): that TRL prepared the model and kept the adapters and
    the modules_to_save copies in fp32, so the flag plans all of them in fp32, not the frozen weights alone."""
    from shardfit.plan.precision import saved_copy_bytes, trainable_bytes

    (tmp_path / "train.py").write_text(SCRIPT.format(imports="", prepare=""))
    (tmp_path / "run.sh").write_text("python train.py --model_name_or_path Qwen/Qwen2.5-0.5B\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0", frozen_fp32=True))
    w = job.workload
    assert w.frozen_fp32 and trainable_bytes(w) == 4 and saved_copy_bytes(w) == 4
    assert any(n.startswith("--frozen-fp32: planned as older TRL") for n in job.notes), job.notes


def test_trl_kto_version_named_as_released(tmp_path: Path) -> None:
    """KTO's bf16 cast (no preparation) came with trl 1.4's experimental KTO trainer, not 1.8."""
    script = SCRIPT.format(imports="", prepare="").replace("SFTConfig, SFTTrainer", "KTOConfig, KTOTrainer").replace(
        "SFTConfig(", "KTOConfig(").replace("SFTTrainer(", "KTOTrainer(").replace(
        "per_device_train_batch_size=1", "per_device_train_batch_size=2")
    job = _hf(tmp_path, script)
    assert any("KTO since 1.4" in n for n in job.notes), job.notes


def test_swift_dtype_follows_the_model_where_torch_dtype_is_unset(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """ms-swift takes an unset --torch_dtype from the model's config.json: a local fp16 model is planned in fp16
    (its 4-bit layers then compute in fp32); a catalog model, whose dtype shardfit does not record, in bf16 under a
    note saying so, unless its download is in the Hugging Face cache (an empty one here: the machine's own cache
    must not decide this test; test_swift_dtype_of_a_catalog_model_is_read_from_its_cached_download)."""
    import json

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    model = tmp_path / "llama2"
    model.mkdir()
    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "torch_dtype": "float16",
              "architectures": ["LlamaForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "run.sh").write_text(SWIFT.replace("Qwen/Qwen2.5-7B-Instruct", str(model)).format(flags=""))
    job = read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.precision == "fp16" and job.workload.bnb_compute_fp32
    (tmp_path / "run.sh").write_text(SWIFT.replace("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-2-7b-hf")
                                     .format(flags=""))
    job = read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.precision == "bf16"
    assert any("catalog does not record" in n for n in job.notes), job.notes



def test_swift_dtype_of_a_catalog_model_is_read_from_its_cached_download(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalog id downloaded before: ms-swift reads the download's config.json, and so does the plan (its
    torch_dtype float16 makes an fp16 job), the note naming where the dtype came from."""
    import json

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--meta-llama--Llama-2-7b-hf" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0123abcd")
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    (tmp_path / "run.sh").write_text(SWIFT.replace("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-2-7b-hf")
                                     .format(flags=""))
    job = read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.precision == "fp16"
    assert any("config.json torch_dtype (float16)" in n for n in job.notes), job.notes

def test_swift_refuses_a_torch_dtype_it_does_not_take(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text(SWIFT.format(flags="--torch_dtype half8"))
    with pytest.raises(UserError, match=r"--torch_dtype half8: ms-swift takes bfloat16, float16 or float32"):
        read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def _trl(tmp_path: Path, flags: str):
    (tmp_path / "run.sh").write_text(f"trl sft --model_name_or_path Qwen/Qwen2.5-0.5B --max_length 1024 {flags}\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def _weights_gib(w) -> float:
    from shardfit.plan.estimate import state_bytes
    from shardfit.plan.shapes import resolve_shape
    return state_bytes(resolve_shape("Qwen/Qwen2.5-0.5B"), w)[0] / 2**30


@pytest.mark.parametrize(("flags", "fp32"), [("--use_peft", True), ("--use_peft --dtype float32", True),
                                             ("--use_peft --dtype bfloat16", False)])
def test_trl_lora_keeps_every_frozen_weight_in_the_dtype_it_loads(tmp_path: Path, flags: str, fp32: bool) -> None:
    """`trl sft --use_peft` loads the model in ModelConfig's --dtype, float32 unless given (trl 1.16
    scripts/sft.py passes it to from_pretrained): under bf16 autocast every frozen weight, the blocks' linears
    too, stays fp32, twice the bytes of a bfloat16 load."""
    w = (job := _trl(tmp_path, flags)).workload
    assert w.method == "lora" and w.precision == "bf16" and w.loaded_fp32 is fp32 and w.frozen_fp32 is fp32
    assert "dtype" not in job.not_modelled
    if fp32:
        bf16 = _trl(tmp_path, "--use_peft --dtype bfloat16").workload
        assert _weights_gib(w) > 1.9 * _weights_gib(bf16)
        assert any("loads the model in fp32: every frozen weight planned in fp32" in n for n in job.notes)


def test_older_trls_torch_dtype_loads_as_dtype_does(tmp_path: Path) -> None:
    """TRL before `dtype` named ModelConfig's field `torch_dtype`: `--torch_dtype bfloat16` loads in bf16 (not the
    float32 default) and is a modelled key."""
    w = (job := _trl(tmp_path, "--use_peft --torch_dtype bfloat16")).workload
    assert not w.loaded_fp32 and "torch_dtype" not in job.not_modelled


def test_a_scripts_own_from_pretrained_dtype_loads_the_model(tmp_path: Path) -> None:
    """A script that parses ModelConfig (get_peft_config) but loads the model itself with a literal dtype loads in
    that one, not in --dtype's float32 default; one that passes model_args.dtype through takes the command line's."""
    body = ("import torch\nfrom transformers import AutoModelForCausalLM\nfrom trl import ModelConfig, SFTTrainer, "
            "get_peft_config\nmodel_args = ModelConfig()\nmodel = AutoModelForCausalLM.from_pretrained("
            "'Qwen/Qwen2.5-0.5B', {dtype})\ntrainer = SFTTrainer(model=model, peft_config=get_peft_config(model_args))"
            "\ntrainer.train()\n")
    for dtype, fp32 in (("torch_dtype=torch.bfloat16", False), ("dtype='bfloat16'", False),
                        ("dtype=model_args.dtype", True)):
        (tmp_path / "train.py").write_text(body.format(dtype=dtype))
        (tmp_path / "run.sh").write_text("accelerate launch train.py --use_peft --bf16 true\n")
        w = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0")).workload
        assert w.loaded_fp32 is fp32, dtype


@pytest.mark.parametrize(("flags", "pure"), [("", False), ("--dtype bfloat16", True), ("--dtype auto", True)])
def test_trl_full_fine_tune_keeps_fp32_masters_only_when_loaded_in_fp32(tmp_path: Path, flags: str,
                                                                         pure: bool) -> None:
    """A full `trl sft` run under bf16: the default float32 load gives autocast fp32 masters; a bfloat16 (or auto,
    a bf16 checkpoint's) load leaves none, so weights, gradients and AdamW states are bf16."""
    w = (job := _trl(tmp_path, flags)).workload
    assert w.method == "full" and w.pure_16bit is pure
    assert any(("no fp32 masters" if pure else "fp32 master weights, as planned") in n for n in job.notes)


def test_trl_full_fine_tune_under_fsdp_keeps_fp32_masters(tmp_path: Path) -> None:
    """accelerate's FSDP upcasts 16-bit trainable parameters to fp32 under mixed precision: a bfloat16 load still
    trains fp32 masters there."""
    w = (job := _trl(tmp_path, "--dtype bfloat16 --fsdp 'full_shard auto_wrap'")).workload
    assert job.engine.startswith("fsdp") and not w.pure_16bit


def test_trl_without_mixed_precision_computes_in_the_loaded_dtype(tmp_path: Path) -> None:
    w = _trl(tmp_path, "--use_peft --dtype bfloat16 --bf16 false").workload
    assert w.precision == "bf16" and not w.loaded_fp32
    assert _trl(tmp_path, "--use_peft --bf16 false").workload.precision == "fp32"


def test_trl_qlora_adapters_are_bf16_without_bf16(tmp_path: Path) -> None:
    """TRL 1.16 casts a 4-bit model's trainables to bf16 whether or not bf16 is on (sft_trainer.py reads neither
    flag): with bf16 and fp16 false the run computes in fp32 (--dtype float32 is the 4-bit compute dtype), but the
    adapters, their gradients and AdamW states are 2 bytes each."""
    from shardfit.plan.precision import trainable_bytes
    w = _trl(tmp_path, "--use_peft --load_in_4bit --bf16 false --fp16 false").workload
    assert w.precision == "fp32" and w.bnb_compute_fp32 and w.adapters_16bit and trainable_bytes(w) == 2


@pytest.mark.parametrize(("extra", "match"), [
    ("fp32_norms: true\n", "without an fsdp_config block"),
    ("fp32_norms: true\nfsdp_version: 1\nfsdp_config:\n  reshard_after_forward: true\n", "fsdp_version 1"),
])
def test_axolotl_refuses_fp32_norms_without_fsdp2(tmp_path: Path, extra: str, match: str) -> None:
    """axolotl's schema refuses fp32_norms outside FSDP2 (0.17.0 to 0.19.0 `check_fp32_norms`)."""
    with pytest.raises(UserError, match=match):
        _axolotl(tmp_path, extra)

