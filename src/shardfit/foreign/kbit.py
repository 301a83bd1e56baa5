"""What each tool does to a 4-bit (QLoRA) model's dtypes after loading it, which the job file does not spell out:
whether the frozen weights outside the 4-bit layers stay fp32 after peft's prepare_model_for_kbit_training, and
the dtype the adapters train in. Shared by the readers (axolotl, TRL scripts, ms-swift) so one rule per tool. And
the dtype an HF script's model loads in (`job_load`: the script's own from_pretrained, TRL's ModelConfig, a TRL
trainer's model_init_kwargs, a known script's argument) and what that does to a LoRA or full run (`apply_load`)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

from shardfit.errors import UserError
from shardfit.foreign.keys import Source
from shardfit.foreign.script_ast import ABSENT_DTYPE, UNSET_DTYPE, ScriptSettings
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.precision import experts_stay_16bit
from shardfit.plan.sdpa_classes import release_of
from shardfit.plan.workload import Workload

# TRL's trainers that, for a 4-bit or 8-bit model, skip prepare_model_for_kbit_training and cast every trainable
# parameter (adapters, modules_to_save copies) to bf16 after get_peft_model (trl 1.16 trainer/*_trainer.py,
# `_is_quantized_model`): SFT from 0.26, DPO from 0.29, KTO from 1.4 (trl 1.3's experimental KTO trainer still
# prepared), and trainer/distillation_trainer.py as 1.16 ships it (the version planned, whatever later TRL does).
TRL_BF16_TRAINERS = ("SFTTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer", "RewardTrainer",
                     "DistillationTrainer")
# TRL's experimental trainers that still call peft's prepare_model_for_kbit_training, then under bf16 cast the
# embeddings and head back to bf16 (trl 1.16 experimental/utils.py `peft_module_casting_to_bf16`; norms stay fp32).
TRL_PREPARING_TRAINERS = ("ORPOTrainer", "CPOTrainer")
# TRL's ModelConfig --dtype choices; float32 is its default (trl 1.16 trainer/model_config.py).
TRL_DTYPES = ("auto", "bfloat16", "float16", "float32")
# How a script that loads the model itself would spell a dtype, for the notes' advice.
SCRIPT_SPELL = "dtype=\"{}\" in the script's from_pretrained"
# ModelConfig's field (`dtype`, trl >= 0.20) and older TRL's name for it; a YAML or JSON of arguments may set either
# to null, which the dataclass takes as None (TrlParser's defaults and HfArgumentParser's parse_dict check no
# choices), so the readers keep a null of these two where they drop other nulls (arg_nulls.py).
LOAD_DTYPE_KEYS = ("dtype", "torch_dtype")
# How model_init_kwargs would spell a dtype, for the notes' advice.
INIT_SPELL = 'model_init_kwargs {{"dtype": "{}"}}'
# Scripts a command runs by name whose model load is an argument with a default of None: transformers' example
# examples/pytorch/language-modeling/run_clm.py hands ModelArguments' `dtype` (4.x: `torch_dtype`; choices
# TRL_DTYPES) to from_pretrained, None where the command line does not give it.
KNOWN_LOADS = {"run_clm.py": ("dtype", "torch_dtype")}
# The engines that keep a full fine-tune's trainable weights in fp32 whatever dtype loaded them: DeepSpeed's ZeRO
# steps fp32 masters; accelerate's FSDP upcasts 16-bit trainable parameters to fp32 under mixed precision
# (utils/fsdp_utils.py `fsdp2_prepare_model`, accelerator.py `prepare_model` for FSDP1).
FP32_MASTER_ENGINES = ("deepspeed", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_offload")
# What --dtype does to each method's weights, as the key's effect.
TRL_DTYPE_EFFECT = {"qlora": "frozen weights loaded, and 4-bit layers computing, in it",
                    "lora": "frozen weights loaded in it", "full": "weights loaded in it"}
# ms-swift's --bnb_4bit_compute_dtype values (swift/arguments/base_args/quant_args.py), as bytes-relevant names.
SWIFT_COMPUTE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def experts_left_fp32(shape: ModelShape, w: Workload, version: str) -> bool:
    """Whether peft's prepare_model_for_kbit_training leaves routed expert stacks in fp32 that a tool's cast of
    the embeddings, norms and head back to the compute dtype does not reach: the stacks bitsandbytes leaves
    unquantized under transformers `version` (plan/precision.py `experts_stay_16bit`; foreign/read.py sets
    `fused_experts` from the same version after the reader)."""
    return experts_stay_16bit(shape, dataclasses.replace(w, fused_experts=release_of(version) >= (5, 0)))


def cast_back(w: Workload, shape: ModelShape, version: str, tool: str) -> tuple[Workload, str]:
    """A tool that runs prepare_model_for_kbit_training and then casts the embeddings, norms (or not) and head back
    to the compute dtype (axolotl; TRL's ORPO and CPO under bf16): the frozen weights are 16-bit again but for the
    expert stacks bitsandbytes left unquantized. shardfit's one switch (`frozen_fp32`) is planned on only where
    those stacks exist (their fp32 bytes dwarf the embeddings'); returns the workload and the note saying so."""
    if experts_left_fp32(shape, w, version):
        return dataclasses.replace(w, frozen_fp32=True), (
            f"{tool} casts the embeddings and head back to {w.precision} after peft's prepare_model_for_kbit_training, "
            "but the routed experts bitsandbytes leaves unquantized stay fp32: planned with fp32 frozen weights "
            "(the embeddings, norms and head too: a small over-estimate)")
    return dataclasses.replace(w, frozen_fp32=False), (
        f"{tool} casts the embeddings, norms and head back to {w.precision} after peft's "
        f"prepare_model_for_kbit_training: frozen weights planned in {w.precision}")


@dataclasses.dataclass(frozen=True)
class Loaded:
    """The dtype an HF job's model loads in (`dtype`, by TRL_DTYPES' names: auto is the checkpoint's), the words
    saying what decides it (`said`, ending "loads the model"), whether the 4-bit layers of a --load_in_4bit run
    compute in fp32 (`bnb_fp32`: TRL's get_quantization_config hands bitsandbytes the same value, and
    BitsAndBytesConfig takes None as fp32), and how the job would spell another dtype (`spell`, "{}" the name)."""

    dtype: str
    said: str
    bnb_fp32: bool
    spell: str = "--dtype {}"
    key: str | None = None  # the job's argument that gives the dtype, where one is not ModelConfig's --dtype
    none: bool = False  # from_pretrained gets None: transformers' default decides (`default_load`)
    fp16_from: str = "--fp16"  # what turns fp16 mixed precision on, where it is on (`job_load`)


def model_config_load(value: object, where: str) -> Loaded:
    """ModelConfig's `--dtype` as given (`where`) or its float32 default: from_pretrained loads in it."""
    dtype = _model_config_dtype(str(value), where)
    return Loaded(dtype, f"TRL's ModelConfig --dtype {dtype} (trl 1.16; float32 unless given) loads the model",
                  dtype == "float32")


def script_load(value: str, at: str, said: str | None = None, spell: str = SCRIPT_SPELL) -> Loaded:
    """The dtype the script's own from_pretrained spells (`at`), which loads the model whatever --dtype says; or
    what `said` names (a from_config, a cast on the chain: ScriptSettings.load_said), spelled another way."""
    said = said or f"the script's from_pretrained at {at} (dtype {value})"
    return Loaded(value, f"{said} loads the model", value == "float32", spell)


def default_load(what: str, version: str, bnb_fp32: bool, spell: str = "--dtype {}") -> Loaded:
    """A from_pretrained that gets no dtype, or None (`what` says why): transformers 5 takes it as "auto", the
    checkpoint's dtype (5.23 modeling_utils.py `from_pretrained`: `if dtype is None: dtype = "auto"`), transformers
    4 as torch's default dtype, fp32 (`_get_dtype`'s "set fp32 as the default dtype for BC")."""
    if release_of(version) >= (5, 0):
        return Loaded("auto", f"{what}; transformers {version} takes None as \"auto\" (4.x: fp32) and loads the "
                              f"model", bnb_fp32, spell, none=True)
    return Loaded("float32", f"{what}; transformers {version} takes None as torch's default, fp32 (5.x: \"auto\", "
                             f"the checkpoint's dtype), and loads the model", bnb_fp32, spell, none=True)


def job_load(src: Source, code: ScriptSettings, version: str, program: str) -> Loaded | None:
    """The dtype the job's model loads in, under transformers `version`: where the script hands its TRL trainer the
    model by name, the trainer's model_init_kwargs (`init_load`); else the script's own from_pretrained where it
    spells a dtype or passes none (ModelConfig's --dtype never reaches it); else TRL's ModelConfig's where the
    script parses one (`model_config_dtype`); else the argument of a script `program` the plan knows
    (KNOWN_LOADS). None where none of these says it (a computed dtype, **kwargs): the plan keeps its precision.
    Each says where fp16 mixed precision comes from (`fp16_from`): --fp16, else accelerate's config."""
    found = _job_load(src, code, version, program)
    fp16_from = "--fp16" if src.flag("fp16", "false") else "the accelerate config's mixed_precision fp16"
    return dataclasses.replace(found, fp16_from=fp16_from) if found is not None else None


def _job_load(src: Source, code: ScriptSettings, version: str, program: str) -> Loaded | None:
    """`job_load` but for where fp16 comes from."""
    found = init_load(src, code, version) if code.model_by_name is not None else None
    if found is not None:
        return found
    if code.unsloth_at is not None:
        return None  # unsloth chooses the dtype by the GPU (script_ast.py `_trained_load` says so)
    if code.load_dtype == UNSET_DTYPE:
        return default_load(f"the script's from_pretrained at {code.load_at} passes no dtype" +
                            (" (ModelConfig's --dtype does not reach it)" if code.model_config else ""), version,
                            False, SCRIPT_SPELL)
    if code.load_dtype is not None:
        return script_load(code.load_dtype, str(code.load_at), code.load_said, code.load_spell or SCRIPT_SPELL)
    if code.model_config:
        return model_config_dtype(src, code, version)
    return known_script_load(src, Path(program).name, version)


def load_keys(code: ScriptSettings, program: str) -> tuple[str, ...]:
    """The arguments that give the job's load dtype: TRL's ModelConfig's where the script parses one, else those of
    a script `program` the plan knows (KNOWN_LOADS); none for another script, whose dataclasses take no dtype."""
    return LOAD_DTYPE_KEYS if code.model_config else KNOWN_LOADS.get(Path(program).name, ())


def model_config_dtype(src: Source, code: ScriptSettings, version: str) -> Loaded:
    """TRL's ModelConfig `dtype` (trl >= 0.20) or older TRL's `torch_dtype`, float32 unless given (trl 1.16's
    default; older TRL's None). A YAML or JSON of arguments that sets it to null hands from_pretrained None (trl 1.16
    trainer/utils.py create_model_from_path passes None on), and bitsandbytes computes in fp32."""
    given = [k for k in LOAD_DTYPE_KEYS if k in src]
    if not given:
        return model_config_load("float32", src.at("dtype"))
    # a null beside a value loses to it (TRL 0.20 to 0.26's __post_init__ copies torch_dtype into a falsy dtype)
    key = next((k for k in given if src.get(k) is not None), given[0])
    if src.get(key) is None:
        return default_load(f"{src.null_at.get(key) or code.config_file or code.arg_file or src.where}: {key}: "
                            f"null, which TRL hands from_pretrained as None", version, True)
    return model_config_load(src.get(key), src.at(key))


def init_load(src: Source, code: ScriptSettings, version: str) -> Loaded | None:
    """The dtype a TRL trainer given the model by name (`code.model_by_name`) loads it in: its config's
    model_init_kwargs (the command line's or YAML's, else the script's literal) go to create_model_from_path, which
    defaults `dtype` to float32 (trl 0.27 to 1.x trainer/utils.py; 0.26: "auto"; older passed none, transformers'
    default) and passes None on. None where the mapping is computed or not one."""
    trainer = f"TRL's {code.trl_trainer or 'trainer'}, given the model by name at {code.model_by_name},"
    raw, where = src.get("model_init_kwargs"), src.at("model_init_kwargs")
    if raw is not None:
        kwargs = _mapping(raw)
        if kwargs is None:
            return None
        dtype = ABSENT_DTYPE if "dtype" not in kwargs else UNSET_DTYPE if kwargs["dtype"] is None else \
            str(kwargs["dtype"]).removeprefix("torch.")
    elif code.init_at is not None:
        dtype, where = code.init_dtype, code.init_at
    else:
        dtype, where = ABSENT_DTYPE, ""
    if dtype is None:
        return None
    if dtype == ABSENT_DTYPE:
        return Loaded("float32", f"{trainer} with no dtype in model_init_kwargs{' at ' + where if where else ''} "
                                 f"(TRL then sets float32: trl 0.27 and later; 0.26 set \"auto\", older TRL "
                                 f"transformers' default) loads the model", False, INIT_SPELL, "model_init_kwargs")
    if dtype == UNSET_DTYPE:
        return default_load(f"{trainer} with model_init_kwargs dtype None at {where}, which TRL passes on",
                            version, False, INIT_SPELL)
    if dtype not in TRL_DTYPES:
        raise UserError(f"{where}: model_init_kwargs dtype {dtype}: TRL's create_model_from_path takes "
                        f"{', '.join(TRL_DTYPES)} (or a torch.dtype) and raises ValueError for any other; use one "
                        f"of those (bfloat16 for a bf16 run).")
    return Loaded(dtype, f"{trainer} with model_init_kwargs dtype {dtype} at {where} loads the model",
                  dtype == "float32", INIT_SPELL, "model_init_kwargs")


def _mapping(raw: object) -> dict[str, object] | None:
    """model_init_kwargs as the job gives it: a mapping, or its JSON (TrainingArguments parses a string that starts
    with "{"), or Python's text of one (a TrlParser YAML's mapping, as the reader keeps it); None for anything else."""
    if isinstance(raw, dict):
        return raw
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(str(raw))
        except (ValueError, SyntaxError):
            continue
        return value if isinstance(value, dict) else None
    return None


def known_script_load(src: Source, name: str, version: str) -> Loaded | None:
    """The dtype a script the plan knows by `name` (KNOWN_LOADS) loads its model in: its argument where given, else
    its default None, which transformers `version` takes as it does (`default_load`). None for another script."""
    keys = KNOWN_LOADS.get(name)
    if keys is None:
        return None
    spell = f"--{keys[0] if release_of(version) >= (5, 0) else keys[1]} {{}}"
    key = next((k for k in keys if src.get(k) is not None), None)
    if key is None:
        null = next((k for k in keys if k in src), None)  # given null: ModelArguments' None, as its default
        said = f"{src.null_at.get(null) or src.where}: {null}: null, which {name} hands from_pretrained as None" \
            if null else f"{name} (transformers' example) hands from_pretrained its {spell.format('')}default, None"
        return dataclasses.replace(default_load(said, version, False, spell), key=null)
    dtype = str(src.get(key)).strip().lower()
    if dtype not in TRL_DTYPES:
        raise UserError(f"{src.at(key)}: --{key} {src.get(key)}: {name} takes {', '.join(TRL_DTYPES)} (its "
                        f"argument parser refuses any other); use one of those (bfloat16 for a bf16 run).")
    return Loaded(dtype, f"{name}'s --{key} {dtype} loads the model", dtype == "float32", spell, key)


def trl_kbit(w: Workload, trainer: str | None, prepares: bool, shape: ModelShape, version: str,
             loaded: Loaded | None = None) -> tuple[Workload, str | None]:
    """A QLoRA job a TRL trainer runs (`trainer`, the class the script builds; `prepares`: the script calls
    prepare_model_for_kbit_training itself; `loaded`: the dtype the model loads in, `job_load`), as TRL 1.16 (the
    version shardfit's bench pins) runs it. The trainers of TRL_BF16_TRAINERS skip the preparation and cast every
    trainable parameter to bf16: 16-bit adapters and saved copies, frozen weights as loaded unless the script
    prepared the model itself. A 4-bit load given no dtype is fp16 under transformers 4 (its bitsandbytes
    quantizer's `update_dtype`, `update_torch_dtype` before 4.56, replaces None with float16), the checkpoint's
    under 5. Returns the workload and a note naming the version and what older TRL did; `w` and None for a job no
    TRL trainer runs."""
    if w.method != "qlora" or trainer is None:
        return w, None
    if trainer in TRL_PREPARING_TRAINERS:
        if w.precision != "bf16":
            return w, None  # peft's preparation, no cast back: as for a Trainer script
        w, note = cast_back(w, shape, version, f"TRL's {trainer} (trl 1.16, experimental)")
        return w, note + " (norms stay fp32, planned as the rest)"
    if trainer not in TRL_BF16_TRAINERS:
        return w, None
    fp16_none = loaded is not None and loaded.none and release_of(version) < (5, 0)
    fp32_load = loaded is not None and loaded.dtype == "float32" and not fp16_none
    w = dataclasses.replace(w, frozen_fp32=prepares or fp32_load, adapters_16bit=True, lora_saved_dtype="trainable",
                            bnb_compute_fp32=w.bnb_compute_fp32 or loaded is not None and loaded.bnb_fp32)
    kept = ("fp32 where the script's own prepare_model_for_kbit_training upcast them" if prepares
            else f"fp32 as loaded ({loaded.said} in fp32; the 4-bit layers compute in fp32 too: "
            f"{loaded.spell.format('bfloat16')} halves them)" if loaded is not None and fp32_load
            else f"fp16 as loaded (transformers {version} loads a 4-bit model given no dtype in fp16; 5.x: the "
            f"checkpoint's), as TRL no longer calls prepare_model_for_kbit_training" if fp16_none
            else f"as loaded ({w.precision}), as TRL no longer calls prepare_model_for_kbit_training")
    return w, (f"TRL's {trainer} on a 4-bit model (trl 1.16; SFT since 0.26, DPO since 0.29, KTO since 1.4) casts "
               f"every trainable parameter to bf16: adapters and saved copies planned in 16 bits, frozen weights "
               f"{kept}; bf16 under bf16 false too, as the cast reads neither flag. Older TRL prepared the model "
               f"(fp32 embeddings, norms, head, adapters and saved copies): "
               f"plan such a run with --frozen-fp32, which plans all of those in fp32")


def apply_load(w: Workload, engine: str, loaded: Loaded | None) -> tuple[Workload, str | None]:
    """A LoRA or full run of an HF script (TRL's or the Trainer's) whose model loads in `loaded`'s dtype
    (`job_load`; None where the job does not say it). Under 16-bit autocast an fp32 load keeps LoRA's frozen
    weights fp32 (`loaded_fp32`; DeepSpeed casts them back) and a full fine-tune's fp32 masters (as planned); a
    16-bit load leaves a full fine-tune no fp32 copy (`pure_16bit`) where accelerate's FSDP or DeepSpeed does not
    keep one: neither transformers' Trainer nor accelerate's prepare_model upcasts trainable weights otherwise
    (accelerate 1.15 upcasts only for FSDP). Without autocast the layers compute in the loaded dtype. Returns the
    workload and a note; `w` and None where `loaded` is None or for QLoRA (`trl_kbit`)."""
    if loaded is None or w.method not in ("lora", "full"):
        return w, None
    said = loaded.said
    if loaded.dtype == "float32":
        if w.precision == "fp32" or w.method == "full":
            return w, None if w.precision == "fp32" else f"{said} in fp32: fp32 master weights, as planned"
        if engine == "deepspeed":
            return w, f"{said} in fp32; DeepSpeed casts the frozen weights to {w.precision} at initialize"
        return dataclasses.replace(w, frozen_fp32=True, loaded_fp32=True), (
            f"{said} in fp32: every frozen weight planned in fp32, {w.precision} autocast casting each per matmul "
            f"({loaded.spell.format('bfloat16')} halves them)")
    low = "fp16" if loaded.dtype == "float16" else "bf16"
    said += f" in {low}" + (f" (auto: the checkpoint's dtype, taken as bf16; an fp32 checkpoint plans as "
                            f"{loaded.spell.format('float32')})" if loaded.dtype == "auto" else "")
    masters = _masters(w, engine)
    if low == w.precision == "fp16" and w.method == "full" and masters is None:
        raise UserError(_FP16_GRADIENTS.format(said=said, fix=loaded.spell.format("bfloat16"),
                                               fp32=loaded.spell.format("float32"), source=loaded.fp16_from))
    if w.precision != "fp32":
        return _loaded_16bit(w, masters, low, said)
    if engine == "deepspeed":
        return w, None
    return dataclasses.replace(w, precision=low, pure_16bit=w.method == "full"), (
        f"{said} and neither bf16 nor fp16 is on: the layers compute in {low}, planned as a {low} run" +
        (" with fp32 adapters (peft upcasts them)" if w.method == "lora" else " with no fp32 masters"))


# A full fine-tune whose trainable weights load in fp16 under fp16 mixed precision, with no engine that keeps fp32
# masters: accelerate's GradScaler unscales the gradients before clipping or stepping (accelerator.py
# `unscale_gradients`), and torch refuses fp16 ones (torch/amp/grad_scaler.py `_unscale_grads_`).
_FP16_GRADIENTS = ("{said}, and fp16 mixed precision ({source}) trains every weight of this full fine-tune in it "
                   "(no DeepSpeed or FSDP keeps fp32 masters): accelerate's GradScaler refuses fp16 gradients at "
                   "the first optimizer step (ValueError: \"Attempting to unscale FP16 gradients.\"), so the job "
                   "fails before step 1. Load in bf16 ({fix}) and train with --bf16 true --fp16 false, or load in "
                   "fp32 ({fp32}) under --fp16 (a GPU without bf16).")


def _masters(w: Workload, engine: str) -> str | None:
    """What keeps fp32 masters of a full fine-tune's 16-bit trainable weights under mixed precision, as the notes
    name it; None where nothing does. accelerate 1.15 upcasts FSDP1's trainable flat params under any sharding
    strategy (accelerator.py `prepare_model`, `if self.mixed_precision != "no"`), NO_SHARD's too, which is planned
    as DDP (common.py `fsdp_engine`): the workload's `fsdp1` says FSDP1 wraps it."""
    if engine in FP32_MASTER_ENGINES:
        return f"the {engine} engine"
    return "accelerate's FSDP1 (NO_SHARD: no sharding, planned as DDP)" if w.runs_fsdp1 else None


def _loaded_16bit(w: Workload, masters: str | None, low: str, said: str) -> tuple[Workload, str | None]:
    """`apply_load` for a model loaded in 16 bits (`low`) under bf16 or fp16 autocast (`w.precision`). Where the two
    differ, autocast casts every weight to its own type for each matmul; it caches only casts of fp32 leaves that
    require grad (torch's autocast `cached_cast`), so each matmul makes its own copy and keeps it for backward, as
    it keeps a frozen fp32 weight's (`loaded_fp32`); the note says so, as the plan holds no such copy."""
    cross = (f"; {w.precision} autocast casts each {low} weight to {w.precision} for every matmul, a copy the matmul "
             f"keeps for backward (autocast caches casts of fp32 weights only), and adds of {low} and {w.precision} "
             f"make the residual stream fp32: neither is planned (an under-estimate; load in {w.precision} to match)"
             if low != w.precision else "")
    if w.method == "lora":
        return w, f"{said}: frozen weights planned in {low}{cross}" if cross or "(auto:" in said else None
    if masters is not None:
        return w, f"{said}; {masters} keeps fp32 masters of the trained weights"
    return dataclasses.replace(w, pure_16bit=True), (
        f"{said}: no fp32 masters, weights, gradients and AdamW states planned in {low}" +
        (cross or f" (autocast over {low} weights casts no weight)"))


def _model_config_dtype(value: str, where: str) -> str:
    """TRL's ModelConfig `--dtype` (trl 1.16 trainer/model_config.py: auto, bfloat16, float16, float32), which
    loads the model and sets the 4-bit compute dtype; a UserError for another, which TRL's parser refuses."""
    dtype = str(value).strip().lower()
    if dtype not in TRL_DTYPES:
        raise UserError(f"{where}: --dtype {value}: TRL's ModelConfig takes {', '.join(TRL_DTYPES)}; use one of "
                        f"those (bfloat16 for a bf16 run).")
    return dtype


def swift_compute_fp32(value: str | None, precision: str, where: str) -> bool:
    """ms-swift's 4-bit compute dtype is fp32: `--bnb_4bit_compute_dtype float32`, or unset (or None) under a
    float16 or float32 `--torch_dtype` (ms-swift 3.0 to 4.x quant_args.py `__post_init__`: bfloat16 only under a
    bfloat16 one). A UserError naming the key for a value ms-swift's argument parser refuses."""
    if value is None or str(value).strip().lower() == "none":
        return precision in ("fp16", "fp32")
    chosen = SWIFT_COMPUTE.get(str(value).strip().lower())
    if chosen is None:
        raise UserError(f"{where}: --bnb_4bit_compute_dtype {value}: ms-swift takes {', '.join(SWIFT_COMPUTE)} "
                        f"(or leave it unset to follow --torch_dtype); use one of those.")
    return chosen == "fp32"
