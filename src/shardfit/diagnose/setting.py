"""What a pasted log shows of the setting a failure happened in: launcher, framework, strategy, model, GPUs.

One error message often has several causes, and the setting decides between them: "cuda:0 and cpu" under ZeRO-3 is
a submodule or a buffer left on the CPU, under ZeRO-3 with CPU offload an optimizer regression; an OOM is a full
replica per GPU when the weights alone exceed the card, activations when the weights are sharded. Users paste the
command line, a config echo or an environment dump (transformers-cli env, accelerate env, pip list, nvidia-smi,
the HF Trainer's "n_gpu" line) around the error, or name the setup in one sentence; this module reads those into a
`Setting` (shown to the user) and into facts the rules in causes.yaml test:

    plain_python          started with `python script.py`, no distributed launcher in sight (nor a script that
                          spawns its own ranks: facts.py's spawns_ranks)
    multi_gpu_visible     the process sees several GPUs (CUDA_VISIBLE_DEVICES, n_gpu, nvidia-smi, "8x A100")
    one_process_many_gpus one process drives several GPUs: nn.DataParallel (HF Trainer without a launcher)
    sharded               ZeRO-3 or FSDP shards the weights
    replica_exceeds_gpu   not sharded, and the weights (or a full fine-tune's state) of one replica exceed one GPU
    full_finetune         the log says full fine-tuning (no LoRA / adapters)
    ranks_exceed_gpus     the launch asks for more processes per node (nproc_per_node, num_processes, --num_gpus)
                          than the GPUs the paste shows visible (CUDA_VISIBLE_DEVICES, --include localhost:0,1)
    ranks_share_gpu       an out-of-memory message lists several processes holding memory on the one GPU that ran out
    gpu_one_holder        an out-of-memory message lists exactly one process holding memory on that GPU
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from shardfit.diagnose.literals import Needles, ascii_squashed, may_match, required_literals

# First match wins: the specific launchers before the generic ones.
_LAUNCHERS = (
    ("llamafactory-cli", r"llamafactory-cli|FORCE_TORCHRUN"),
    ("swift", r"\bswift (?:sft|rlhf|pt|infer|train)\b|NPROC_PER_NODE=\d+ swift"),
    ("accelerate", r"accelerate launch|accelerate/commands/launch|accelerate\.commands\.launch"),
    # env assignments before the command: the name holds no "=", so a glued "a=1b=2" splits one way only (an
    # ambiguous split backtracks exponentially on a long line of key=value numbers)
    ("deepspeed", r"^\s*(?:[^\s=]+=\S+\s+)*deepspeed\s+(?:--\w|\S+\.py)|deepspeed\.launcher|launcher/runner\.py|"
                  r"\[launch\.py:\d+:main\]"),
    ("torchrun", r"\btorchrun\b|torch\.distributed\.(?:run|launch)\b|distributed/run\.py"),
    ("mpirun/srun", r"\bmpirun\b|\bmpiexec\b|\bsrun\b"),
    ("ray", r"\bray\s+(?:start|job)|RayTaskError|\((?:\w+ )?pid=\d+, ip=|ray/_private"),
    ("python", r"(?:^|[\s$;&])python3?(?:\.\d+)?\s+(?:-u\s+)?(?!-m\s+torch\.distributed)"
               r"(?:-m\s+\w[\w.]*|[\w./-]+\.py)\b"),
)
_FRAMEWORKS = (
    ("LLaMA-Factory", r"llamafactory|llmtuner|LLaMA-Factory|src/train_bash\.py|--stage sft"),
    ("ms-swift", r"ms-swift|\bswift/(?:llm|trainers)|\bswift (?:sft|rlhf|pt)\b|\bllm_sft\b|\[INFO:swift\]|"
                 r"\b(?:Sft|Train|RLHF)Arguments\(model"),
    ("axolotl", r"axolotl"),
    ("xtuner", r"\bxtuner\b|mmengine"),
    ("OpenRLHF", r"openrlhf"),
    ("verl", r"\bverl[./]"),
    ("TRL", r"\btrl/|\b(?:SFT|DPO|GRPO|PPO|KTO|ORPO|Reward)Trainer\b|\btrl\b"),
    ("Lightning", r"lightning|pl\.Trainer"),
    ("Megatron", r"megatron"),
    ("HF Trainer", r"transformers/trainer\.py|TrainingArguments|--per_device_train_batch_size|Trainer\.train|"
                   r"trainer\.train\(|\bn_gpu\b"),
)
_MODEL = re.compile(r"(?:--model_name_or_path|model_name_or_path:|--model(?:_id_or_path|_type|_path)?|base_model:|"
                    r"from_pretrained\(\s*|\(model(?:_id_or_path|_name_or_path)?=)[\s=:'\"]*([\w./-]{3,120})", re.I)
_VISIBLE = re.compile(r"(?:CUDA_VISIBLE_DEVICES\s*[=:]\s*|--include[=\s]+['\"]?localhost:)['\"]?(\d+(?:\s*,\s*\d+)*)")
_GPU_HOLDERS = re.compile(r"Process (\d+) has \d+(?:\.\d+)? [GMK]iB memory in use")
_N_GPU = re.compile(r"\bn_gpu\s*[:=]\s*(\d+)")
_COUNT = re.compile(r"\b(\d{1,2})\s*(?:x|\*|×)?\s*(?:NVIDIA\s+)?(?:A100|H100|H800|H20|A800|V100|A6000|A10G?|"
                    r"L40S?|L4|T4|RTX|GPU|4090|3090)|\b(\d{1,2})\s+(?:NVIDIA\s+)?(?:A100|H100|H800|A800|V100|A6000|"
                    r"L40S?|4090|3090|RTX \w+|T4|L4)?\s*GPUs\b|(?:Number of GPUs|GPU count|num_gpus)\s*[:=]\s*(\d+)",
                    re.I)
_SMI_ROW = re.compile(r"^\|?\s*(\d)\s+(?:NVIDIA|Tesla|GeForce|Quadro)\b", re.M)
_CAPACITY = re.compile(r"(\d+(?:\.\d+)?) GiB total capacity|total capac\w* of (\d+(?:\.\d+)?) GiB")
# Card name -> memory (GiB) where the name alone says it; the capacity in an OOM message wins when present.
_CARDS = (
    (r"A100[-\s_]*(?:SXM4?[-\s_]*|PCIE[-\s_]*)?80\s*G|H100|H800|A800|H200", 80.0),
    (r"A100[-\s_]*(?:SXM4?[-\s_]*|PCIE[-\s_]*)?40\s*G", 40.0), (r"\bA100\b", 80.0),
    (r"A6000|L40S?|A40\b|RTX 6000 Ada", 48.0), (r"V100[-\s_]*(?:SXM2[-\s_]*)?32\s*G", 32.0), (r"V100", 16.0),
    (r"4090|3090|A10G?\b|\bL4\b|A5000|TITAN RTX", 24.0), (r"\bT4\b|4080|A4000|4060 Ti", 16.0),
    (r"3080|2080 Ti|3060", 12.0), (r"\bH20\b", 96.0),
)
_FULL_FT = re.compile(r"finetuning_type[\s:=]+full|(?:sft|train)_type[\s:=]+full|full[- ]fine-?tun|full[- ]parameter|"
                      r"--full\b|full_finetune", re.I)
_ADAPTER = re.compile(r"\blora\b|qlora|\bpeft\b|adapter|finetuning_type[\s:=]+(?:lora|freeze)", re.I)

_CARD_RX = tuple((re.compile(pat, re.I), gib) for pat, gib in _CARDS)


@dataclass
class Setting:
    launcher: str | None = None
    framework: str | None = None
    strategy: str | None = None
    model: str | None = None
    model_size_b: float | None = None
    gpus_visible: int | None = None
    gpu_mem_gib: float | None = None
    replica_gib: float | None = None

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _compiled(table: tuple[tuple[str, str], ...], flags: int) -> tuple[tuple[str, re.Pattern, Needles | None], ...]:
    """A table's patterns compiled once, each with the words one of which its match holds (literals.py)."""
    return tuple((name, rx, required_literals(rx)) for name, pat in table for rx in [re.compile(pat, flags)])


def _first(table: tuple[tuple[str, re.Pattern, Needles | None], ...], text: str, hay: str | None) -> str | None:
    """The name of the first pattern of `table` found in `text` (`hay`: the text squashed, to skip the others)."""
    return next((name for name, rx, words in table if may_match(words, hay) and rx.search(text)), None)


_LAUNCHER_RX = _compiled(_LAUNCHERS, re.I | re.M)
_FRAMEWORK_RX = _compiled(_FRAMEWORKS, re.I | re.M)


def gpu_rows(raw: str) -> int:
    """GPUs listed in an nvidia-smi table of the raw paste (normalisation folds those rows into one, so they are
    counted before it)."""
    return len({m.group(1) for m in _SMI_ROW.finditer(raw)})


def _gpus_visible(text: str, smi_rows: int) -> int | None:
    counts = [len(m.group(1).split(",")) for m in _VISIBLE.finditer(text)]
    counts += [int(m.group(1)) for m in _N_GPU.finditer(text)]
    counts += [int(g) for m in _COUNT.finditer(text) for g in m.groups() if g]
    if smi_rows > 1:
        counts.append(smi_rows)
    return max(counts) if counts else None


def _gpu_mem(text: str) -> float | None:
    caps = [float(g) for m in _CAPACITY.finditer(text) for g in m.groups() if g]
    if caps:
        return max(caps)
    for pat, gib in _CARD_RX:
        if pat.search(text):
            return gib
    return None


def _strategy(facts: set[str], zero_stage: int | None, launcher: str | None) -> str | None:
    if "one_process_many_gpus" in facts:
        return "DataParallel (one process, several GPUs)"
    if "fsdp" in facts:
        return "FSDP"
    if zero_stage is not None:
        return f"ZeRO-{zero_stage}" + (" + offload" if "offload" in facts else "")
    if "device_map_split" in facts:
        return "device_map split (one process)"
    if "ddp" in facts or (launcher not in (None, "python", "ray") and "deepspeed" not in facts):
        return "DDP"
    return None


def visible_counts(text: str) -> list[int]:
    """The GPU counts the launch restricts the job to (each CUDA_VISIBLE_DEVICES list, DeepSpeed's --include)."""
    return [len(m.group(1).split(",")) for m in _VISIBLE.finditer(text)]


def _rank_facts(text: str, facts: set[str], ranks_per_node: int | None) -> None:
    """Processes against GPUs: more ranks requested than the launch makes visible, or several processes found
    holding memory on the GPU that ran out (two ranks on one GPU, or every rank putting something on cuda:0)."""
    visible = visible_counts(text)
    if ranks_per_node and visible and ranks_per_node > min(visible):
        facts.add("ranks_exceed_gpus")
    holders = len(set(_GPU_HOLDERS.findall(text)))
    if holders >= 2:
        facts.add("ranks_share_gpu")
    elif holders == 1:
        facts.add("gpu_one_holder")  # the OOM message lists one process on the GPU: no other rank shares it


def read_setting(text: str, facts: set[str], zero_stage: int | None, model_size_b: float | None,
                 smi_rows: int = 0, ranks_per_node: int | None = None) -> Setting:
    """The setting the log shows; adds the facts listed in the module docstring to `facts`."""
    hay = ascii_squashed(text)
    s = Setting(launcher=_first(_LAUNCHER_RX, text, hay), framework=_first(_FRAMEWORK_RX, text, hay),
                model_size_b=model_size_b)
    m = _MODEL.search(text)
    s.model = m.group(1).strip("'\"") if m else None
    s.gpus_visible = _gpus_visible(text, smi_rows)
    s.gpu_mem_gib = _gpu_mem(text)
    if s.launcher == "python" and "multi_rank" not in facts and "spawns_ranks" not in facts:
        facts.add("plain_python")
    if s.gpus_visible and s.gpus_visible > 1:
        facts.add("multi_gpu_visible")
    n_gpu = [int(x) for x in _N_GPU.findall(text)]
    if "spawns_ranks" not in facts and ((n_gpu and max(n_gpu) > 1) or
                                        ("plain_python" in facts and "multi_gpu_visible" in facts)):
        facts.add("one_process_many_gpus")
    if "zero3" in facts or "fsdp" in facts:
        facts.add("sharded")
    _rank_facts(text, facts, ranks_per_node)
    if _FULL_FT.search(text) and not _ADAPTER.search(text):
        facts.add("full_finetune")
    if model_size_b and "sharded" not in facts and "device_map_split" not in facts:
        per_param = 0.6 if re.search(r"4.?bit|qlora|nf4", text, re.I) else 1.1 if "8bit" in text.lower() else 2.0
        if "full_finetune" in facts:
            per_param = 16.0  # bf16 weights and grads, fp32 Adam moments and master weights
        s.replica_gib = round(model_size_b * per_param * 1e9 / 2**30, 1)
        if s.gpu_mem_gib and s.replica_gib > 0.85 * s.gpu_mem_gib:
            facts.add("replica_exceeds_gpu")
    s.strategy = _strategy(facts, zero_stage, s.launcher)
    return s
