"""The dtype an HF job's model loads in beyond TRL's ModelConfig (foreign/kbit.py `job_load`): a plain Trainer
script's own from_pretrained (no dtype: transformers 5 takes None as "auto", 4.x as fp32), transformers' run_clm.py
(its --dtype defaults to None), and a TRL trainer handed the model by name (create_model_from_path: float32 unless
model_init_kwargs gives a dtype, trl 0.27 and later). And what transformers 4 loads a 4-bit model in given None
(bitsandbytes' quantizer makes it fp16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job

TRAINER = ("from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
           "from peft import LoraConfig, get_peft_model\n"
           "import torch\n"
           "model = AutoModelForCausalLM.from_pretrained(\"Qwen/Qwen2.5-0.5B\"{load})\n"
           "{peft}"
           "args = TrainingArguments(output_dir=\"o\", bf16=True, per_device_train_batch_size=1, max_length=512)\n"
           "Trainer(model=model, args=args).train()\n")
PEFT = "model = get_peft_model(model, LoraConfig(r=8))\n"


def _plain(tmp_path: Path, load: str = "", peft: str = "", version: str = "5.23.0", launch: str = "python"):
    (tmp_path / "train.py").write_text(TRAINER.format(load=load, peft=peft))
    (tmp_path / "run.sh").write_text(f"{launch} train.py\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers=version))


@pytest.mark.parametrize(("version", "fp32"), [("4.57.1", True), ("5.23.0", False)])
def test_a_plain_lora_script_without_dtype_loads_as_transformers_does(tmp_path: Path, version: str,
                                                                     fp32: bool) -> None:
    """No ModelConfig: the Trainer script's from_pretrained without a dtype loads fp32 under transformers 4, so
    LoRA keeps fp32 frozen weights under bf16 autocast; under 5 it loads the checkpoint's bf16."""
    job = _plain(tmp_path, peft=PEFT, version=version)
    assert job.workload.method == "lora" and job.workload.loaded_fp32 is fp32 and job.workload.frozen_fp32 is fp32
    note = next(n for n in job.notes if "passes no dtype" in n)
    assert "train.py:4" in note and f"transformers {version}" in note and "ModelConfig" not in note
    assert ("4.x: fp32" if version.startswith("5") else '5.x: "auto"') in note


def test_a_plain_full_fine_tune_without_dtype(tmp_path: Path) -> None:
    """Transformers 5 loads the bf16 checkpoint and neither the Trainer nor accelerate's DDP upcasts it: no fp32
    masters. Transformers 4 loads fp32: masters, as planned."""
    w5 = _plain(tmp_path, version="5.23.0").workload
    assert w5.method == "full" and w5.pure_16bit
    job4 = _plain(tmp_path, version="4.57.1")
    assert not job4.workload.pure_16bit
    assert any("fp32 master weights, as planned" in n for n in job4.notes), job4.notes


@pytest.mark.parametrize(("load", "pure"), [(", torch_dtype=torch.bfloat16", True), (", dtype=\"float32\"", False),
                                            (", **kwargs", False)])
def test_a_plain_full_fine_tune_with_a_literal_dtype(tmp_path: Path, load: str, pure: bool) -> None:
    """A literal dtype loads the model in it under either transformers; **kwargs may hold one: left as before."""
    job = _plain(tmp_path, load=load, version="4.57.1")
    assert job.workload.pure_16bit is pure


def test_deepspeed_keeps_fp32_masters_of_a_bf16_load(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, '
                                      '"train_micro_batch_size_per_gpu": "auto"}')
    (tmp_path / "train.py").write_text(TRAINER.format(load="", peft=""))
    (tmp_path / "run.sh").write_text("deepspeed --num_gpus 2 train.py --deepspeed ds.json\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.engine == "deepspeed" and not job.workload.pure_16bit


CLM = "torchrun --nproc_per_node 2 run_clm.py --model_name_or_path Qwen/Qwen2.5-0.5B --bf16 --do_train {flags}\n"


@pytest.mark.parametrize(("flags", "version", "pure"), [("", "5.23.0", True), ("", "4.57.1", False),
                                                        ("--dtype float32", "5.23.0", False),
                                                        ("--torch_dtype bfloat16", "4.57.1", True)])
def test_run_clm_loads_in_its_dtype_argument_or_none(tmp_path: Path, flags: str, version: str, pure: bool) -> None:
    """transformers' run_clm.py hands from_pretrained ModelArguments' dtype (4.x: torch_dtype), None by default."""
    (tmp_path / "run.sh").write_text(CLM.format(flags=flags))
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers=version))
    assert job.workload.method == "full" and job.workload.pure_16bit is pure
    if not flags:
        assert any("run_clm.py" in n and "None" in n and f"transformers {version}" in n for n in job.notes)
    else:
        assert flags.split()[0].lstrip("-") in job.keys


def test_run_clm_refuses_a_dtype_its_parser_refuses(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text(CLM.format(flags="--dtype bf16"))
    with pytest.raises(UserError, match=r"--dtype bf16: run_clm.py takes auto, bfloat16"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


BY_NAME = ("import torch\n"
           "from trl import {trainer}, {config}\n"
           "from peft import LoraConfig\n"
           "MODEL = \"Qwen/Qwen2.5-0.5B\"\n"
           "args = {config}(output_dir=\"o\", bf16=True, max_length=512{init})\n"
           "{trainer}(model={model}, args=args{peft}).train()\n")


def _by_name(tmp_path: Path, init: str = "", peft: str = ", peft_config=LoraConfig(r=8)", flags: str = "",
             trainer: str = "SFTTrainer", model: str = "MODEL"):
    config = trainer.replace("Trainer", "Config")
    (tmp_path / "train.py").write_text(BY_NAME.format(trainer=trainer, config=config, init=init, peft=peft,
                                                      model=model))
    (tmp_path / "run.sh").write_text(f"accelerate launch train.py {flags}\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_a_model_given_by_name_loads_in_fp32_by_default(tmp_path: Path) -> None:
    """SFTTrainer(model="...") with no model_init_kwargs: TRL's create_model_from_path loads float32 (trl 0.27+);
    the literal name is the job's model."""
    job = _by_name(tmp_path)
    assert job.model == "Qwen/Qwen2.5-0.5B"
    assert job.workload.loaded_fp32 and job.workload.frozen_fp32
    note = next(n for n in job.notes if "given the model by name at train.py:6" in n)
    assert "float32" in note and "0.26" in note and 'model_init_kwargs {"dtype": "bfloat16"}' in note


@pytest.mark.parametrize(("init", "flags", "loaded_fp32"), [
    (', model_init_kwargs={"dtype": torch.bfloat16}', "", False),
    (", model_init_kwargs=dict(dtype=\"auto\")", "", False),
    (", model_init_kwargs={\"torch_dtype\": \"bfloat16\"}", "", True),
    ("", "--model_init_kwargs '{\"dtype\": \"bfloat16\"}'", False)])
def test_model_init_kwargs_dtype_loads_a_model_given_by_name(tmp_path: Path, init: str, flags: str,
                                                             loaded_fp32: bool) -> None:
    """The dtype model_init_kwargs gives (in code or on the command line) loads it; a torch_dtype alone loses to
    the float32 TRL sets as `dtype` beside it."""
    job = _by_name(tmp_path, init=init, flags=flags)
    assert job.workload.loaded_fp32 is loaded_fp32


def test_a_full_fine_tune_by_name_with_auto_is_pure_16bit(tmp_path: Path) -> None:
    job = _by_name(tmp_path, init=", model_init_kwargs={\"dtype\": \"auto\"}", peft="")
    assert job.workload.method == "full" and job.workload.pure_16bit


def test_model_init_kwargs_dtype_none_loads_as_transformers_takes_none(tmp_path: Path) -> None:
    job = _by_name(tmp_path, init=", model_init_kwargs={\"dtype\": None}")
    assert not job.workload.loaded_fp32
    assert any('takes None as "auto"' in n and "model_init_kwargs dtype None" in n for n in job.notes), job.notes


def test_dpo_given_the_model_args_name(tmp_path: Path) -> None:
    """DPOTrainer(model=model_args.model_name_or_path): a name, loaded by TRL in float32."""
    job = _by_name(tmp_path, trainer="DPOTrainer", model="model_args.model_name_or_path",
                   flags="--model_name_or_path Qwen/Qwen2.5-0.5B")
    assert job.workload.loaded_fp32
    assert any("TRL's DPOTrainer, given the model by name" in n for n in job.notes), job.notes


def test_a_bad_model_init_kwargs_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"model_init_kwargs dtype bf16: TRL's create_model_from_path takes"):
        _by_name(tmp_path, flags="--model_init_kwargs '{\"dtype\": \"bf16\"}'")


def test_a_null_dtype_4bit_load_is_fp16_under_transformers_4(tmp_path: Path) -> None:
    """TRL hands None to from_pretrained with a 4-bit quantization config: transformers 4's bitsandbytes quantizer
    loads the rest in fp16, not fp32, and the 4-bit layers compute in fp32 (BitsAndBytesConfig's None)."""
    (tmp_path / "job.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nmax_length: 512\nbf16: true\n"
                                       "use_peft: true\nload_in_4bit: true\ndtype: null\n")
    (tmp_path / "run.sh").write_text("trl sft --config job.yaml\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="4.57.1"))
    w = job.workload
    assert w.method == "qlora" and not w.frozen_fp32 and w.bnb_compute_fp32
    assert any("frozen weights fp16 as loaded (transformers 4.57.1" in n for n in job.notes), job.notes


def test_model_init_kwargs_set_from_model_config_keeps_its_dtype(tmp_path: Path) -> None:
    """TRL's own sft.py before 0.17 set `training_args.model_init_kwargs = model_kwargs` (ModelConfig's dtype) and
    handed SFTTrainer the name: ModelConfig's --dtype loads it, not TRL's float32 default."""
    (tmp_path / "train.py").write_text(
        "from trl import ModelConfig, SFTConfig, SFTTrainer, TrlParser, get_peft_config\n"
        "script_args, training_args, model_args = TrlParser((SFTConfig, ModelConfig)).parse_args_and_config()\n"
        "model_kwargs = dict(torch_dtype=model_args.torch_dtype)\n"
        "training_args.model_init_kwargs = model_kwargs\n"
        "SFTTrainer(model=model_args.model_name_or_path, args=training_args, "
        "peft_config=get_peft_config(model_args)).train()\n")
    (tmp_path / "run.sh").write_text("accelerate launch train.py --model_name_or_path Qwen/Qwen2.5-0.5B --bf16 true "
                                     "--max_length 512 --use_peft --dtype bfloat16\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert not job.workload.loaded_fp32
    assert not any("given the model by name" in n for n in job.notes), job.notes


HEAD = ("import torch\n"
        "from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification\n"
        "from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser, get_peft_config\n")
PARSE = ("    _, training_args, model_args = TrlParser((ScriptArguments, SFTConfig, ModelConfig))"
         ".parse_args_and_config()\n")
TRAIN = ("    trainer = SFTTrainer(model=model, args=training_args, peft_config=get_peft_config(model_args))\n"
         "    trainer.train()\n")


def _trained(tmp_path: Path, body: str, flags: str = "--use_peft --dtype float32", version: str = "5.23.0"):
    (tmp_path / "train.py").write_text(HEAD + body + "\nif __name__ == \"__main__\":\n    main()\n")
    (tmp_path / "run.sh").write_text(f"accelerate launch train.py --model_name_or_path Qwen/Qwen2.5-0.5B --bf16 true "
                                     f"--max_length 1024 {flags}\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers=version))


def _model_config_note(job) -> bool:
    """ModelConfig's --dtype float32 loaded the model: LoRA's frozen weights fp32 under bf16 autocast."""
    return job.workload.loaded_fp32 and any("ModelConfig --dtype float32" in n for n in job.notes)


def test_a_merge_step_defined_first_does_not_decide_the_load(tmp_path: Path) -> None:
    """The merge after training loads the base in fp16 in a function written above main: the trained model is the
    one main hands SFTTrainer, loaded with ModelConfig's dtype through get_peft_model and .to()."""
    job = _trained(tmp_path, "def merge(path):\n"
                             "    base = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float16)\n"
                             "    return base\n"
                             "def main():\n" + PARSE +
                             "    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, "
                             "dtype=model_args.dtype).to('cuda')\n"
                             "    model = get_peft_model(model, get_peft_config(model_args))\n" + TRAIN +
                             "    merge(training_args.output_dir)\n")
    assert _model_config_note(job), job.notes
    assert not any("train.py:5" in n for n in job.notes), job.notes


def test_a_helper_never_called_does_not_decide_the_load(tmp_path: Path) -> None:
    """A helper loads in fp16 and nothing calls it; the trained model comes from a function the script imports,
    so nothing ties it: the one load left is the helper's, which never runs: ModelConfig's dtype."""
    job = _trained(tmp_path, "from helpers import build\n"
                             "def load_for_eval(path):\n"
                             "    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float16)\n"
                             "def main():\n" + PARSE + "    model = build(model_args)\n" + TRAIN)
    assert _model_config_note(job), job.notes
    assert not any("dtype float16" in n for n in job.notes), job.notes


def test_a_reward_model_loaded_first_does_not_decide_the_load(tmp_path: Path) -> None:
    job = _trained(tmp_path, "def main():\n" + PARSE +
                             "    reward = AutoModelForSequenceClassification.from_pretrained('OpenAssistant/rm', "
                             "num_labels=1, torch_dtype=torch.bfloat16)\n"
                             "    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, "
                             "dtype=model_args.dtype)\n" + TRAIN)
    assert _model_config_note(job), job.notes


def test_the_load_the_trainer_gets_decides_where_the_model_loads_twice(tmp_path: Path) -> None:
    """The model is loaded once to read it (no dtype), then again with ModelConfig's dtype for training."""
    job = _trained(tmp_path, "def main():\n" + PARSE +
                             "    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)\n"
                             "    vocab = model.config.vocab_size\n"
                             "    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, "
                             "dtype=model_args.dtype)\n" + TRAIN)
    assert _model_config_note(job), job.notes
    assert not any("passes no dtype" in n for n in job.notes), job.notes


def test_a_trainer_tied_to_a_classification_head_trains_it(tmp_path: Path) -> None:
    """Tied to the trainer, a sequence-classification load is the trained one (a reward model's own training)."""
    (tmp_path / "train.py").write_text(
        "import torch\nfrom transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments\n"
        "args = TrainingArguments(output_dir='o', bf16=True, max_length=512)\n"
        "model = AutoModelForSequenceClassification.from_pretrained('Qwen/Qwen2.5-0.5B', num_labels=1, "
        "torch_dtype=torch.bfloat16)\n"
        "Trainer(model=model, args=args).train()\n")
    (tmp_path / "run.sh").write_text("python train.py\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="4.57.1"))
    assert job.workload.pure_16bit, job.notes


def test_unsloth_picks_its_own_dtype(tmp_path: Path) -> None:
    """FastLanguageModel.from_pretrained(dtype=None) is bf16 where the GPU has it (unsloth's own choice), not
    transformers' None: the load is left unplanned and the note says so."""
    (tmp_path / "train.py").write_text(
        "from unsloth import FastLanguageModel\nfrom trl import SFTConfig, SFTTrainer\n"
        "model, tokenizer = FastLanguageModel.from_pretrained(model_name='unsloth/Qwen2.5-0.5B', "
        "max_seq_length=1024, dtype=None, load_in_4bit=False)\n"
        "model = FastLanguageModel.get_peft_model(model, r=16)\n"
        "SFTTrainer(model=model, args=SFTConfig(output_dir='o', bf16=True, max_length=1024)).train()\n")
    (tmp_path / "run.sh").write_text("python train.py --use_lora true\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="4.57.1", model="Qwen/Qwen2.5-0.5B"))
    assert not job.workload.loaded_fp32, job.notes
    assert not any("passes no dtype" in n for n in job.notes), job.notes
    assert any("unsloth picks its own dtype" in n and "train.py:3" in n for n in job.notes), job.notes


def test_loads_that_disagree_and_are_not_tied_fall_back_to_model_config(tmp_path: Path) -> None:
    job = _trained(tmp_path, "def main():\n" + PARSE +
                             "    if model_args.use_peft:\n"
                             "        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)\n"
                             "    else:\n"
                             "        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, "
                             "torch_dtype=torch.float16)\n" + TRAIN)
    assert _model_config_note(job), job.notes
    assert any("models load in different dtypes at train.py:7, train.py:9" in n and "ModelConfig" in n
               for n in job.notes), job.notes


def test_null_dtypes_no_one_reads_stay_quiet(tmp_path: Path) -> None:
    """A plain Trainer script's JSON of arguments with "torch_dtype": null: no dataclass of the script reads it,
    so the null means nothing, as other nulls do (no "not modelled" line)."""
    (tmp_path / "train.py").write_text(
        "import sys\nimport torch\nfrom transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, "
        "TrainingArguments\n"
        "(args,) = HfArgumentParser(TrainingArguments).parse_json_file(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(\"Qwen/Qwen2.5-0.5B\", torch_dtype=torch.bfloat16)\n"
        "Trainer(model=model, args=args).train()\n")
    (tmp_path / "args.json").write_text('{"output_dir": "o", "bf16": true, "max_length": 512, "torch_dtype": null, '
                                        '"dtype": null}')
    (tmp_path / "run.sh").write_text("python train.py args.json\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert "torch_dtype" not in job.not_modelled and "dtype" not in job.not_modelled, job.not_modelled
    assert job.workload.pure_16bit


def test_run_clms_null_dtype_is_read_as_its_default(tmp_path: Path) -> None:
    """run_clm.py reads a JSON of arguments too: its null dtype is ModelArguments' None, planned with the key."""
    (tmp_path / "args.json").write_text('{"model_name_or_path": "Qwen/Qwen2.5-0.5B", "output_dir": "o", "bf16": true, '
                                        '"do_train": true, "dtype": null}')
    (tmp_path / "run_clm.py").write_text(
        "import sys\nfrom transformers import HfArgumentParser, TrainingArguments\n"
        "model_args, data_args, training_args = HfArgumentParser((ModelArguments, DataTrainingArguments, "
        "TrainingArguments)).parse_json_file(json_file=sys.argv[1])\n")
    (tmp_path / "run.sh").write_text("python run_clm.py args.json\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert "dtype" not in job.not_modelled and "dtype" in job.keys, (job.not_modelled, job.keys)
    assert job.workload.pure_16bit


def test_run_clms_block_size_is_its_sequence_length(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text(CLM.format(flags="--block_size 512"))
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.seq_len == 512 and "block_size" in job.keys, job.not_modelled
    assert not any("planned at 2048" in n for n in job.notes), job.notes


def test_run_clm_without_block_size_says_its_default(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text(CLM.format(flags=""))
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.seq_len == 2048
    assert [n for n in job.notes if "2048" in n] == [next(n for n in job.notes if "run_clm.py without --block_size"
                                                          in n)], job.notes


def test_another_scripts_block_size_is_not_its_sequence_length(tmp_path: Path) -> None:
    """Only run_clm.py's --block_size is known to be the sequence length."""
    (tmp_path / "train.py").write_text(TRAINER.format(load="", peft=""))
    (tmp_path / "run.sh").write_text("python train.py --block_size 512\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.seq_len == 512 and "block_size" in job.not_modelled  # max_length=512 in the script


@pytest.mark.parametrize("null", [True, False])
def test_seq_given_says_one_thing(tmp_path: Path, null: bool) -> None:
    """--seq with no length in the arguments (or a null one): one note, the one that says --seq, not 2048 too."""
    (tmp_path / "job.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nbf16: true\n" +
                                       ("max_length: null\n" if null else ""))
    (tmp_path / "run.sh").write_text("trl sft --config job.yaml\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0", seq=4096))
    assert job.workload.seq_len == 4096
    assert not any("2048" in n for n in job.notes), job.notes
    assert len([n for n in job.notes if "--seq 4096" in n]) == 1, job.notes


PLAIN = ("import torch\n"
         "from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments\n"
         "{body}"
         "args = TrainingArguments(output_dir='o', bf16=True, per_device_train_batch_size=1, max_length=512)\n"
         "{train}")


def _script(tmp_path: Path, body: str, train: str = "Trainer(model=model, args=args).train()\n",
            version: str = "5.23.0"):
    (tmp_path / "train.py").write_text(PLAIN.format(body=body, train=train))
    (tmp_path / "run.sh").write_text("python train.py\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers=version, model="Qwen/Qwen2.5-0.5B"))


REF = "ref = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', dtype=torch.bfloat16)\n"


def test_from_config_is_the_trained_load_not_the_reference_beside_it(tmp_path: Path) -> None:
    """from_config builds the trained model, in the config's dtype (transformers 5.23 `_from_config`: dtype
    defaults to config.dtype, the checkpoint's for AutoConfig.from_pretrained); the bf16 `ref` decides nothing."""
    job = _script(tmp_path, "cfg = AutoConfig.from_pretrained('Qwen/Qwen2.5-0.5B')\n"
                            "model = AutoModelForCausalLM.from_config(cfg)\n" + REF)
    note = next(n for n in job.notes if "from_config at train.py:4" in n)
    assert "checkpoint" in note and job.workload.pure_16bit, job.notes
    assert not any("train.py:5" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("build", "pure"), [("LlamaConfig(hidden_size=64)", False),
                                             ("LlamaConfig(hidden_size=64, dtype='bfloat16')", True),
                                             ("AutoConfig.from_pretrained('Qwen/Qwen2.5-0.5B'), dtype=None", False),
                                             ("AutoConfig.from_pretrained('x'), torch_dtype=torch.float32", False)])
def test_from_config_builds_in_its_dtype_or_the_configs(tmp_path: Path, build: str, pure: bool) -> None:
    """A config built in the script has no dtype unless given: torch's default, fp32 (masters, as planned); a
    dtype argument of None is torch's default too (not the config's)."""
    job = _script(tmp_path, f"model = AutoModelForCausalLM.from_config({build})\n" + REF)
    assert job.workload.pure_16bit is pure, job.notes
    assert any("from_config at train.py:3" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("chain", "low"), [(".half()", "fp16"), (".to(dtype=torch.bfloat16)", "bf16"),
                                            (".cuda().bfloat16()", "bf16"), (".to('cuda', torch.float16)", "fp16"),
                                            (".half().float()", None)])
def test_a_cast_on_the_chain_is_the_load_dtype(tmp_path: Path, chain: str, low: str | None) -> None:
    """.half(), .bfloat16(), .float() and .to(torch.X) cast the loaded weights: the last cast is the dtype."""
    job = _script(tmp_path, f"model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', "
                            f"dtype=torch.float32){chain}\n")
    assert job.workload.pure_16bit is (low is not None), job.notes
    method = chain.rsplit(").", 1)[-1].split("(")[0].lstrip(".")
    note = next(n for n in job.notes if f"{method}(" in n and "train.py:3" in n)
    assert f"in {low or 'fp32'}" in note, note


def test_a_call_that_cannot_be_followed_ties_nothing(tmp_path: Path) -> None:
    """The trained model comes from a function the script imports: the one load left (`ref`, bf16) is not it."""
    job = _script(tmp_path, "from helpers import build\nmodel = build()\n" + REF)
    assert not job.workload.pure_16bit, job.notes
    assert any("build() at train.py:4" in n and "cannot follow" in n for n in job.notes), job.notes


TWO = ("a = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', dtype=torch.float32)\n"
       "b = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', dtype=torch.bfloat16)\n")


@pytest.mark.parametrize("train", ["Trainer(model=a, args=args)\nTrainer(model=b, args=args).train()\n",
                                   "t = Trainer(model=a, args=args)\nu = Trainer(model=b, args=args)\nu.train()\n",
                                   "def run(m):\n    return m\nt = Trainer(model=b, args=args)\n"
                                   "u = Trainer(model=a, args=args)\nt.train()\n"])
def test_the_trainer_whose_train_runs_is_tied(tmp_path: Path, train: str) -> None:
    job = _script(tmp_path, TWO, train)
    assert job.workload.pure_16bit, job.notes
    assert any("from_pretrained at train.py:4" in n for n in job.notes), job.notes


def test_two_trainers_none_trained_say_so(tmp_path: Path) -> None:
    job = _script(tmp_path, TWO, "t = Trainer(model=a, args=args)\nu = Trainer(model=b, args=args)\n")
    assert any("trainers at train.py:6, train.py:7" in n and "cannot be told" in n for n in job.notes), job.notes


ACC = ("compute_environment: LOCAL_MACHINE\ndistributed_type: {kind}\nmixed_precision: {mp}\nnum_processes: 2\n"
       "fsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n  fsdp_version: 1\n"
       "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
ACC_SCRIPT = ("import torch\nfrom transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, "
              "TrainingArguments\n"
              "(args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()\n"
              "model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', dtype=torch.{dtype})\n"
              "Trainer(model=model, args=args).train()\n")


def _accelerate(tmp_path: Path, kind: str, mp: str, dtype: str, flags: str = ""):
    (tmp_path / "acc.yaml").write_text(ACC.format(kind=kind, mp=mp))
    (tmp_path / "train.py").write_text(ACC_SCRIPT.format(dtype=dtype))
    (tmp_path / "run.sh").write_text(f"accelerate launch --config_file acc.yaml train.py --output_dir o "
                                     f"--max_length 512 {flags}\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


@pytest.mark.parametrize(("mp", "dtype"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_fsdp_no_shard_under_mixed_precision_keeps_fp32_masters(tmp_path: Path, mp: str, dtype: str) -> None:
    """accelerate 1.15 upcasts FSDP1's trainable flat params to fp32 under mixed precision whatever the sharding
    strategy (accelerator.py `prepare_model`): NO_SHARD, planned as DDP, keeps fp32 masters of a 16-bit load."""
    job = _accelerate(tmp_path, "FSDP", mp, dtype)
    assert job.engine == "ddp" and job.workload.precision == mp and not job.workload.pure_16bit, job.notes
    assert any("FSDP" in n and "fp32 masters" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("mp", "flags", "source"), [("fp16", "", "the accelerate config's mixed_precision fp16"),
                                                     ("no", "--fp16 true", "--fp16")])
def test_the_fp16_refusal_names_where_fp16_comes_from(tmp_path: Path, mp: str, flags: str, source: str) -> None:
    with pytest.raises(UserError, match=f"fp16 mixed precision \\({source}\\)"):
        _accelerate(tmp_path, "MULTI_GPU", mp, "float16", flags)


@pytest.mark.parametrize(("after", "low"), [("model.half()\n", "fp16"), ("model.to(torch.bfloat16)\n", "bf16"),
                                            ("model.half()\nmodel.float()\n", None),
                                            ("model.to('cuda')\n", None), ("other.half()\n", None),
                                            ("if small:\n    model.half()\n", None)])
def test_a_cast_called_as_its_own_statement_casts_in_place(tmp_path: Path, after: str, low: str | None) -> None:
    """nn.Module's casts change the weights in place: `model.half()` on a line of its own before the trainer casts
    the model it trains, as `model = model.half()` does; a move to a device, a cast of another model, or one that
    runs only sometimes does not decide it."""
    job = _script(tmp_path, "model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', "
                            "dtype=torch.float32)\n" + after)
    assert job.workload.pure_16bit is (low is not None), job.notes
