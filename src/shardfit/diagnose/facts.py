"""The facts the rules test, gathered from a parsed log: the knowledge file's named patterns, the configuration the
log shows (ZeRO stage, world size, device_map, dtype, model size), NCCL work items and barriers, data preparation
progress, and what the traceback says (exit codes, signals, the user's own call, where a memory fault surfaced).

Also the keyed line filter that makes a fact's long alternation cheap (`LineFilter`) and its check (`crosses_lines`).
"""

from __future__ import annotations

import re

try:  # the regex's parsed form: which pieces can match a line break (re._parser from Python 3.11)
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_parse  # type: ignore[no-redef]
from dataclasses import dataclass
from functools import cache

from shardfit.diagnose.literals import Haystack, may_match, required_literals
from shardfit.diagnose.parsed import LIBRARY_PATH, WRAPPER_TYPES, Parsed, match_frame
from shardfit.diagnose.regex import Regex
from shardfit.diagnose.setting import visible_counts

SYMPTOM_PREFIX = "sym_"

# A TypeError about a call's arguments raised where the user's own code called a method of the user's own class
# (the frame above it is outside the installed libraries and the frameworks' trees, and the class is none of the
# libraries'): the user's mistake, not a library that changed a signature.
_ARG_ERROR = re.compile(r"^(?P<cls>[A-Za-z_]\w*)\.(?P<method>\w+)\(\) (takes (from \d+ to )?\d+ positional "
                        r"arguments? but \d+ (was|were) given|missing \d+ required (positional|keyword-only) "
                        r"arguments?|got an unexpected keyword argument|got multiple values for argument)")
# the libraries' own classes (a user's subclass has its own name: PairwiseTrainer, DistillTrainer)
_LIBRARY_CLASS = re.compile(
    r"(SFT|DPO|PPO|GRPO|KTO|ORPO|CPO|RLOO|BCO|PRM|GKD|XPO|Reward|Seq2Seq|OnlineDPO|IterativeSFT|NashMD)?Trainer|"
    r"\w+(ForCausalLM|ForConditionalGeneration|ForSequenceClassification|PreTrainedModel|DecoderLayer)|"
    r"\w*Attention\w*|Peft\w*|Lora\w*|Accelerator|DeepSpeed\w*|Lightning\w*|Module|Tensor|"
    r"\w*(Config|Tokenizer\w*|Processor|Arguments|Engine)")

# Pasted bare (no frame anywhere), the class and the method are all there is. A framework calls the user's
# subclass hooks (a Trainer's compute_loss / training_step, Lightning's *_step): another release passing other
# arguments is the classic version break, so a hook is never the user's own call. Neither is a class named after a
# model family (Qwen2Model, BertModel: the library's), nor a library's collator, tuner (peft's BaseTuner) or mixin.
_FRAMEWORK_HOOK = re.compile(
    r"training_step|compute_loss|prediction_step|evaluation_loop|_save|_save_checkpoint|create_optimizer\w*|"
    r"create_scheduler|get_train_dataloader|get_eval_dataloader|_get_train_sampler|_prepare_inputs|get_batch_samples|"
    r"_maybe_log_save_evaluate|_load_from_checkpoint|log|on_\w+|configure_optimizers|validation_step|test_step|"
    r"predict_step|optimizer_step|backward|_inner_training_loop|evaluate|save_model|_wrap_model|floating_point_ops|"
    # TRL's loops call these on a DPO / GRPO / PPO / KTO subclass; a DataLoader calls a collator's __call__
    r"get_batch_loss_metrics|concatenated_forward|concatenated_inputs|_generate_and_score_completions|"
    r"_?compute_rewards?\w*|_get_per_token_logps|compute_ref_log_probs|tokenize_row|_prepare_dataset|dpo_loss|"
    r"__call__|torch_call|numpy_call")
# a subclass of a framework's trainer or callback, by a name holding the trainer's (PatchedGRPO, DistillTrainerKL);
# not a model part or dataset of the user's named after the method (RewardHead, SFTDataset, DPOLoss)
_FRAMEWORK_CLASS = re.compile(r"(?!\w*(Head|Model|Net|Module|Layer|Encoder|Decoder|Loss|Dataset)$)"
                              r"\w*(Trainer|Callback|DPO|GRPO|PPO|KTO|ORPO|SFT|Reward)\w*")
_FAMILY_CLASS = re.compile(
    r"(Llama|Qwen|Mistral|Mixtral|Gemma|Phi|GPT|Falcon|Baichuan|ChatGLM|GLM|InternLM|DeepSeek|Bert|Roberta|Deberta|"
    r"T5|MT5|Bart|Whisper|CLIP|Clip|Siglip|Llava|LLaVA|Idefics|Mllama|OPT|Bloom|Olmo|Cohere|Starcoder|MiniCPM|ViT|"
    r"Vit|Wav2Vec2|Mamba|Jamba|Granite|Pixtral|Paligemma|PaliGemma|Florence|Blip|Yi|Gemma\d|Hunyuan|Ernie|Aquila|"
    r"DataCollator|Megatron|MCore)\w*|\w+(Tuner|Mixin)")


# A memory fault is blamed on a compiled extension only when no other code is shown failing: frames of torch, triton's
# launcher and the model libraries pass the fault through; an extension's own frame names it.
_FAULT_PASS_PATH = re.compile(r"(^|/)(torch|triton|transformers|peft|accelerate|trl)/")
# frames that launch the kernel of the code above them (triton's JIT, a custom op's dispatch) rather than run an op
_LAUNCH_PATH = re.compile(r"(^|/)triton/|(^|/)torch/_ops\.py$")
_EXT_PATH = re.compile(r"(^|/)(flash_attn\w*|xformers|apex|bitsandbytes|vllm|transformer_engine|liger_kernel|mamba_ssm|"
                       r"causal_conv1d|unsloth\w*)/")


def _fault_outside_ext(p: Parsed) -> bool:
    """The innermost frame that is not torch's, triton's or a model library's lies outside every compiled extension
    (the user's own Triton or CUDA kernel, a library's Python code such as DeepSpeed's hooks) and only a kernel
    launcher (triton's, a custom op's dispatch) runs below it, or the paste shows the user's own `@triton.jit` kernel.

    A torch or model-library frame below that frame means the fault surfaced in their op: the user's script (or
    DeepSpeed's engine) only called down into it. CUDA reports a fault at the next call that synchronises, so such a
    traceback says no more about the kernel at fault than the bare error line, and keeps the bare line's ranking; that
    holds for a ZeRO-3 `engine.backward` too, where autograd runs every op's backward kernel (an extension's included)
    with no frame of the op shown."""
    last, below = None, False
    for line in p.lines:
        if ".py" in line and (m := match_frame(line)):
            f = m.group("file").replace("\\", "/")
            if not _FAULT_PASS_PATH.search(f):
                last, below = f, False
            elif last is not None and not _LAUNCH_PATH.search(f):
                below = True
    if last is None:
        return "@triton.jit" in p.text
    return not below and not _EXT_PATH.search(last)


def _library_kwarg_error(p: Parsed) -> bool:
    """The primary exception is a TypeError about an unexpected keyword argument, raised in an installed library's
    frame that the user's code called into (transformers' from_pretrained forwarding the caller's keywords to the
    model's __init__, a trainer passing its own to a hook): a keyword one release knows and the installed one does
    not, whichever side spelled it."""
    e = p.exception
    if e is None or e.type != "TypeError" or "got an unexpected keyword argument" not in e.message:
        return False
    files = [m.group("file").replace("\\", "/") for line in p.lines[:e.line] if (m := match_frame(line))]
    return bool(files) and bool(LIBRARY_PATH.search(files[-1])) and any(not LIBRARY_PATH.search(f) for f in files)


# CPython's message for a local read before any assignment reached it (Python/ceval.c, UNBOUNDLOCAL_ERROR_MSG: "local
# variable '%s' referenced before assignment" before 3.11, "cannot access local variable '%s' where it is not
# associated with a value" from 3.11)
_UNBOUND = re.compile(r"UnboundLocalError|local variable '\w+' referenced before assignment|cannot access local "
                      r"variable '\w+' where it is not associated with a value")


# what ends a search upwards for the frame that raised an error: the header or exception line of another traceback
_TRACEBACK_EDGE = re.compile(r"Traceback \(most recent call last\)|^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)\b")
RAISING_FRAME_LINES = 12  # a frame's source line, python 3.11's carets, rich's context lines lie between


def _raising_frame(lines: list[str], at: int) -> str | None:
    """The file of the frame just above the error line `lines[at]`: the innermost frame of the traceback that raised
    it, or None where no frame of that traceback is shown (the error named in prose, above another traceback)."""
    for line in reversed(lines[max(0, at - RAISING_FRAME_LINES):at]):
        if ".py" in line and (m := match_frame(line)):
            return m.group("file").replace("\\", "/")
        if _TRACEBACK_EDGE.search(line):
            return None
    return None


def _unbound_in_library(p: Parsed) -> bool:
    """A local read before assignment raised in an installed library's frame: a code path of that release that never
    set the variable (a branch its authors did not run), fixed by another release. The frame is the innermost one of
    the traceback the error ends, not the paste's last (a launcher's own traceback follows a rank's); where the error
    is only named (a title, a sentence) and the paste's traceback is cut before its message, the cut traceback's
    innermost frame in a library's code (parse.py, cut_frames) is where it was raised."""
    if not _UNBOUND.search(p.text):
        return False
    raising = [_raising_frame(p.lines, i) for i, line in enumerate(p.lines) if _UNBOUND.search(line)]
    shown = [f for f in raising if f is not None]
    if shown:
        return any(LIBRARY_PATH.search(f) for f in shown)
    return bool(p.cut_frames)


def _own_call(p: Parsed) -> bool:
    """The primary exception is an argument TypeError of a user's class, raised in a frame of the user's code; or,
    pasted with no frame at all, one of a user's class (no library's, no model family's, no subclass of a
    framework's Trainer or callback) in a method no framework calls on the user's behalf."""
    e = p.exception
    m = _ARG_ERROR.match(e.message) if e is not None and e.type == "TypeError" else None
    if m is None or _LIBRARY_CLASS.fullmatch(m.group("cls")):
        return False
    for line in reversed(p.lines[max(0, e.line - 4):e.line]):
        if f := match_frame(line):
            return not LIBRARY_PATH.search(f.group("file").replace("\\", "/"))
    cls, method = m.group("cls"), m.group("method")
    # a subclass of a framework's Trainer or callback: the framework calls any of its methods, not only the hooks
    return not (p.frames or _FRAMEWORK_HOOK.fullmatch(method) or _FAMILY_CLASS.fullmatch(cls)
                or _FRAMEWORK_CLASS.fullmatch(cls))


# a code line calling the gradient-checkpointing hook (not the TypeError's "_set_gradient_checkpointing()", not its
# definition); the receiver, where one is written, is the first group
_GC_CALL = re.compile(r"^(?!\s*def\b)[^\n]*?(?:(\w+)\.)?_set_gradient_checkpointing\((?!\))")


def _own_gc_call(p: Parsed) -> bool:
    """The paste shows the user's own code calling `_set_gradient_checkpointing(...)`: the call's frame is a file no
    library or model repository ships (transformers' gradient_checkpointing_enable calls it from modeling_utils.py,
    a remote model's own code from transformers_modules/), or, shown without a frame, the call is on an object
    other than `self` (a script's `model._set_gradient_checkpointing(model, value=True)`). The keyword it refuses
    is then the script's, written for another transformers release, not the model code's old API."""
    if "_set_gradient_checkpointing(" not in p.text:
        return False
    for i, line in enumerate(p.lines):
        if not (m := _GC_CALL.match(line)):
            continue
        frame = match_frame(p.lines[i - 1]) if i else None
        if frame is not None:
            file = frame.group("file").replace("\\", "/")
            if not LIBRARY_PATH.search(file) and "transformers_modules/" not in file:
                return True
        elif m.group(1) not in (None, "self"):
            return True
    return False


_SEQ = re.compile(r"SeqNum=(\d+), OpType=(\w+)(?:, NumelIn=(\d+))?")
# the watchdog names the rank whose own work timed out (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, the
# watchdog's "[Rank N] Watchdog caught collective operation timeout: WorkNCCL(...)"): that rank was in the collective
_RANK_SEQ = re.compile(r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), "
                       r"OpType=\w+, NumelIn=(\d+)")
_ELAPSED = re.compile(r"\[(\d+):(\d\d)(?::(\d\d))?<")
# datasets' own bars are named "Map", "Filter" ("Map (num_proc=8):", arrow_dataset.py's default desc) in that case
# and with a colon: a detector's "mAP@.5" column in an evaluation bar is not data preparation
_PROGRESS_DATA = re.compile(r"tokeniz|(?-i:\b(?:Map|Filter)(?: \(num_proc=\d+\))?:)|examples/s|ba/s|"
                            r"Generating \w+ split|pre-?process|dataset", re.I)
# a CUDA release named in the paste (the toolkit torch was built with, "cu102", nvidia-smi's "CUDA Version") and a GPU
# of the Ampere generation or newer: CUDA 10.x and older cannot build for sm_80 and up (CUDA 11.0 added sm_80, 11.1
# sm_86), so a torch built with them has no kernel image for the card
_CUDA_RELEASE = re.compile(r"\b(?:cuda(?:toolkit)?|cuda version|cuda runtime)[\s:=_-]{0,3}v?(\d{1,2})\.\d|"
                           r"\+cu(1\d\d|[89]\d)\b|\bcu(1\d\d|[89]\d)(?=\b|_)", re.I)
_AMPERE_OR_NEWER = re.compile(r"\bRTX ?(?:30[5-9]0|40[6-9]0|50[6-9]0)\b|\b(?:30[5-9]0|40[6-9]0|50[7-9]0)(?: ?Ti)?\b|"
                              r"\bA(?:100|800|6000|5000|4000|40|30|10G?)\b|\bH(?:100|800|200|20)\b|\bL40S?\b|"
                              r"\bB200\b|\bRTX (?:PRO )?[456]000 Ada\b|sm_(?:8\d|9\d|1[0-2]\d)\b", re.I)
# a data module's own INFO line ("INFO:x.data.datasets.utils:Building indexing ...", "[INFO] packing sequences")
_DATA_LOG = re.compile(r"^(?:\[?INFO\]?[: ]|I\d{4} |\S+ - INFO - )[^\n]*(?:data_?sets?\b|data\.|packed|packing|"
                       r"tokeniz|mem-?mapped|indexing|indices)", re.I)
_PROGRESS_BAR_STOP = re.compile(r"error|exception|traceback|killed|timed? ?out|warn", re.I)
_MODEL_SIZE = re.compile(r"(?:(?<=[-_/\s(:])|^)(\d{1,3}(?:\.\d)?)[bB](?![a-zA-Z0-9])", re.M)
_WORLD = re.compile(r"(?:--nproc[_-]per[_-]node|--num_gpus|--num[_-]processes|NPROC_PER_NODE|num_processes|"
                    r"GPUS_PER_NODE|dist_world_size|world[ _]size|"
                    # mpirun/mpiexec's process count (-n, -np, --n, --np, Open MPI's -c), after any other options
                    # (--hostfile h, --allow-run-as-root) but not in the program's own arguments; case-sensitive,
                    # because Open MPI's -N is processes per node, not the world size
                    # (a program run by path, ./a.out, ends mpirun's options: a -n after it is the program's; an
                    # option's own path value, --hostfile ./hosts or --mca key value, does not)
                    r"\b(?:mpirun|mpiexec)\b(?:\s+(?:--?(?:hostfile|machinefile|prefix|wdir|app|rankfile|x|H|host)"
                    r"[\s=]+[^\s|;&]+|--?mca\s+\S+\s+[^\s|;&]+|(?!python|\S*\.py\b|\.{1,2}/)[^\s|;&]+)){0,40}?"
                    r"\s+(?-i:--?np?|-c))"
                    r"[\s:=]+(\d+)",
                    re.I)
_STAGE = re.compile(r'"stage"\s*:\s*(\d)|zero_stage[\s:=]+(\d)|\bzero[_-]?stage[\s:=]*(\d)|\bds_z(\d)'
                    r"|(?:\b|_)zero-?(\d)(?:\b|_)|deepspeed[_-]zero(\d)|\bzero(\d)[_.]|ZeRO stage (\d)|stage(\d)\.py"
                    r"|\bds_(?:config_)?(\d)\.json"
                    # a DeepSpeed config file named for its stage (ds_config/stage3.json, ds_stage2.json)
                    r"|\b(?:ds|deepspeed|zero)[^\s`'\"]{0,40}?stage_?(\d)\.json"
                    r"|zero[^\n]{0,30}stage[\s:=_-]*(\d)\b|\bdeepspeed[^\n]{0,20}\bstage[\s:=_-]*(\d)\b"
                    r"|stage_1_and_2\.py()", re.I)


@dataclass(frozen=True)
class LineFilter:
    """A fact's regex tried only on the lines that hold one of its literal keys (any case): a substring test per
    line is far cheaper than a long alternation tried at every position. Every alternative of the regex must
    contain one of the keys, and must not span lines, for the answer to be the plain search's."""

    pattern: re.Pattern | Regex
    keys: tuple[str, ...]  # lower case

    def search(self, text: str) -> re.Match | None:
        for line in text.split("\n"):
            low = line.lower()
            if any(k in low for k in self.keys):
                m = self.pattern.search(line)
                if m:
                    return m
        return None


FactPattern = re.Pattern | Regex | LineFilter


def _set_has_newline(items: list, negate: bool = False) -> bool:
    """Whether a character set of the parsed regex (its items: literals, ranges, categories) holds a line break."""
    hit = False
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            hit = hit or av == 10
        elif name == "RANGE":
            hit = hit or av[0] <= 10 <= av[1]
        elif name == "CATEGORY":
            hit = hit or str(av) in ("CATEGORY_SPACE", "CATEGORY_NOT_WORD", "CATEGORY_NOT_DIGIT",
                                     "CATEGORY_LINEBREAK")
    return hit != negate


def crosses_lines(pattern: re.Pattern) -> str | None:
    """The first piece of a regex that can match a line break (`\\s`, `\\W`, `[^x]`, `.` under DOTALL), else None: a
    LineFilter cuts the text at line breaks, so a keyed pattern must hold none to answer as the plain search."""
    dotall = bool(pattern.flags & re.S)

    def walk(tree: object) -> str | None:
        for op, av in tree:
            name = str(op)
            if name == "ANY" and dotall:
                return "'.' under DOTALL"
            if (name == "LITERAL" and av == 10) or (name == "NOT_LITERAL" and av != 10):
                return "a character that may be a line break"
            if name == "IN" and _set_has_newline(av):
                return "a character class holding the line break (\\s, \\W, [^...] without \\n)"
            for sub in (av if isinstance(av, (tuple, list)) else ()):
                found = None
                if isinstance(sub, sre_parse.SubPattern):
                    found = walk(sub)
                elif isinstance(sub, list) and sub and all(isinstance(x, sre_parse.SubPattern) for x in sub):
                    found = next((f for f in map(walk, sub) if f), None)
                if found:
                    return found
        return None

    return walk(sre_parse.parse(pattern.pattern, pattern.flags))


# c10d's store-based barrier at process-group set-up (torch/distributed/distributed_c10d.py, _store_based_barrier):
# every process adds one to the key and waits for the count to reach world_size; the timeout names both numbers
# ("worker_count=", "num_workers_joined=" from torch 2.1)
_BARRIER = re.compile(r"store based barrier[^\n]{0,160}\(world_size=(\d+), (?:worker_count|num_workers_joined)=(\d+)")


def _barrier_facts(p: Parsed, text: str) -> None:
    """More processes joined the store-based barrier than the group's world size: a second launcher layer (srun tasks
    that each spawn a process per GPU) or a store shared with another run, not a rank that is late."""
    if any(int(m.group(2)) > int(m.group(1)) for m in _BARRIER.finditer(text)):
        p.facts.add("barrier_extra_workers")


def _collective_facts(p: Parsed, text: str) -> None:
    """The NCCL work items the watchdog names (SeqNum, OpType, NumelIn) and what their numbers say: an early
    collective (the first steps), one that moves the weights, a late one (after training ran)."""
    for m in _SEQ.finditer(text):
        p.nccl_ops.append((int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None))
    if not p.nccl_ops:
        return
    if min(s for s, _, _ in p.nccl_ops) <= 5:
        p.facts.add("nccl_early_collective")
    # an early collective of a million elements or more moves the model's weights (DDP's first broadcast of its
    # parameters, in 250 MB buckets), not a barrier (main_process_first's is one element)
    if any(s <= 5 and (n or 0) >= 1_000_000 for s, _, n in p.nccl_ops):
        p.facts.add("nccl_early_weights")
    if max(s for s, _, _ in p.nccl_ops) >= 1000:
        p.facts.add("nccl_late_collective")
    if _rank0_waits(_RANK_SEQ.findall(text), _world_of(p)):
        p.facts.add("nccl_rank0_in_step")


# a launch over several nodes: torchrun's --nnodes (N or MIN:MAX), DeepSpeed's --num_nodes, accelerate's
# --num_machines, and a node's own rank (torchrun's --node_rank, accelerate's and detectron2's --machine_rank)
_NODES = re.compile(r"--(?:nnodes|num[_-]nodes|num[_-]machines)[\s=]+(?:\d+:)?(\d+)")
_NODE_RANK = re.compile(r"--(?:node|machine)[_-]rank[\s=]+(\d+)?")
# torchrun's and DeepSpeed's fixed node count (not an elastic MIN:MAX range), which multiplies the processes per node;
# accelerate's --num_processes is already the whole job's
_FIXED_NODES = re.compile(r"--(?:nnodes|num[_-]nodes)[\s=]+(\d+)\b(?!:)")
_TOTAL_PROCESSES = re.compile(r"--num[_-]processes|\bnum_processes\b")


def _multi_node(text: str) -> bool:
    """The launch spans several nodes, or names a node's rank without saying the nodes are one (a node count in a
    shell variable): the ranks on this node are not the whole world. `--nnodes=1 --node_rank=0` is one node."""
    counts = [int(n) for n in _NODES.findall(text)]
    ranks = _NODE_RANK.findall(text)
    if any(r and int(r) > 0 for r in ranks) or any(n > 1 for n in counts):
        return True
    return bool(ranks) and not counts


def _world_of(p: Parsed) -> int | None:
    """The whole job's rank count where the paste shows it: the launch's world size on one node, or its processes
    per node times the nodes of a torchrun / DeepSpeed launch; None where the count is not shown."""
    if not p.world_size:
        return None
    nodes = [int(n) for n in _FIXED_NODES.findall(p.text)]
    if nodes and not _TOTAL_PROCESSES.search(p.text):
        return p.world_size * max(nodes)
    return None if _multi_node(p.text) else p.world_size


def _rank0_waits(timed_out: list[tuple[str, str, str]], world: int | None = None) -> bool:
    """Rank 0's own watchdog line, after the first steps, shows it waiting for the others (rank, SeqNum, NumelIn
    per line): it was not the rank saving a checkpoint or preparing data. Either it waits in a collective of data
    size (a thousand elements or more: gradients, activations, weights; a barrier is one element and
    broadcast_object_list's size header one per rank, the collectives a save's late rank 0 enters), or it timed out
    in the same collective (SeqNum) as another rank: both were in it, and the rank that never came is another. Not
    when every rank of the `world` (where the paste shows it) timed out in that collective: all of them entered it
    (a transport that hangs), no rank is missing."""
    zero = [(int(s), int(n)) for r, s, n in timed_out if r == "0" and int(s) > 5]
    others = {int(s) for r, s, _ in timed_out if r != "0"}

    def missing(seq: int) -> bool:
        ranks = {int(r) for r, s, _ in timed_out if int(s) == seq}
        return world is None or max(ranks) >= world or len(ranks) < world

    return any(n >= 1000 or (s in others and missing(s)) for s, n in zero)


# the reporter's words for a job over several machines ("2 machines with 5 gpus", "multi-node", "多机多卡"). "Nodes"
# alone is also a graph's vertices ("a graph with 2708 nodes") or a cluster's size ("our cluster has 3 nodes"), so
# nodes count only beside GPUs or a launch: "2 nodes with 8 GPUs", "2 nodes x 8", "8 GPUs x 2 nodes", "on 2 nodes",
# "2-node training"
_NODE_COUNT = r"(?:[2-9]|[1-9]\d{1,2}|two|three|four|several|multiple)"
_NODES_SAID = re.compile(
    rf"\b{_NODE_COUNT}[ \t]+(?:machines|servers|hosts)\b|\bmulti-?(?:node|machine)\b|多机|多节点|多台|"
    rf"\b{_NODE_COUNT}[ \t]+nodes?\b[ \t,]*(?:(?:with|of|and|x|×|\*)[ \t]*)?(?:\d+|two|four|eight)?[ \t]*"
    r"(?:[\w-]+[ \t]+)?(?:gpus?|cards?|a100s?|h100s?|h800s?|a800s?)\b|"
    rf"\b{_NODE_COUNT}[ \t]+nodes?[ \t]*(?:x|×|\*)[ \t]*\d|"
    rf"\b(?:gpus?|cards?)[ \t]*(?:x|×|\*|,|each)[ \t]*{_NODE_COUNT}[ \t]+nodes\b|"
    rf"\b(?:on|across|over|using|spanning|to)[ \t]+{_NODE_COUNT}[ \t]+nodes\b|"
    rf"\b{_NODE_COUNT}[ \t-]+nodes?[ \t]+(?:training|jobs?|runs?|launch\w*|setups?|ddp|fsdp|deepspeed|fine-?tun\w*|"
    r"pre-?train\w*)\b", re.I)


def _rank_fit_facts(p: Parsed) -> None:
    """The launch starts no more processes per node than the GPUs it makes visible (nproc_per_node 4 beside a
    CUDA_VISIBLE_DEVICES of four): each rank's local_rank is a valid device, so an invalid ordinal came from the
    script's own device choice (a hard-coded cuda:N, a --gpu_id), not from the rank count. Not on one node of
    several: a script choosing its device by the global RANK reaches ordinals past the node's GPUs (multi_node,
    from the launch's flags or the reporter's words)."""
    visible = visible_counts(p.brief)
    several = _multi_node(p.text)
    if several or _NODES_SAID.search(p.brief):
        p.facts.add("multi_node")
    if p.world_size and p.world_size > 1 and visible and p.world_size <= min(visible) and not several:
        p.facts.add("ranks_fit_gpus")


# a script that starts its own ranks, one process per GPU: torch.multiprocessing.spawn (torch/multiprocessing/spawn.py),
# detectron2's launch() (detectron2/engine/launch.py: mp.spawn of num_gpus_per_machine workers; it logs "Process group
# URL:" when init fails, and its Namespace echo holds num_machines=N), torchvision's and pytorch/examples' recipes'
# --multiprocessing-distributed (mp.spawn of one worker per GPU)
_SPAWNS = re.compile(r"torch/multiprocessing/spawn\.py|\b(?:mp|multiprocessing)\.spawn\(|detectron2/engine/launch\.py|"
                     r"^Process group URL: |--multiprocessing-distributed\b|\bnum_machines=\d", re.M)
# detectron2's command line (engine/defaults.py, default_argument_parser: --num-gpus per machine beside --num-machines,
# --machine-rank or --dist-url on one line). Either flag alone is not a spawn: accelerate's launch takes
# --num_machines, and DeiT / MAE style scripts take --dist_url when torchrun starts their ranks.
_DETECTRON2_ARGS = re.compile(r"^(?=[^\n]*--num-gpus\b)[^\n]*--(?:num-machines|machine-rank|dist-url)\b", re.M)


def _spawn_facts(p: Parsed, text: str) -> None:
    """The script starts its own ranks (spawns_ranks): started with `python script.py`, it is still one process per
    GPU, not one process driving several (nn.DataParallel)."""
    if _SPAWNS.search(text) or _DETECTRON2_ARGS.search(text):
        p.facts.add("spawns_ranks")


# the micro-batch said to be one: a config echo or command line (per_device_train_batch_size=1, batch_size: 1) or the
# reporter's words ("already set the batch size to 1", "even with batch size 1", "batch size 设为 1")
_BATCH_ONE = re.compile(r"(?:batch[ _-]?size|\bbs|micro[_ ]batch\w*)[`'\"]?[^\n\d]{0,30}?(?:already|even|set to|"
                        r"down to|reduced to|lowered to|\bto|=|:|\bof|\bis|为|设为|设置为|设成)"
                        r"\s*[`'\"]?1\b(?!\.\d|\d)|"
                        r"even (?:with|at) (?:a )?batch(?: size)? (?:of )?1\b|"
                        # a command line's `--flag VALUE`: the value follows the key after blanks only
                        r"(?<=[-_])(?:batch[_-]size|micro[_-]batch\w*)[ \t]+1\b(?!\.\d|\d)", re.I)
# a batch size that is not the training step's: evaluation, test, prediction, inference (per_device_eval_batch_size,
# --test_batch_size, "inference batch size"), verl's forward-only log_prob micro-batches, generation and RL rollout
# batches (--gen_batch_size, --rollout_batch_size) and an inference engine's ceiling (--max_batch_size) hold no
# gradients
_NOT_TRAIN_BATCH = re.compile(r"(?<![a-z])(?:eval\w*|val(?:id\w*)?|test\w*|predict\w*|infer\w*|log_prob\w*|"
                              r"generat\w*|gen|rollout\w*|max)[ _-]?$", re.I)


def _batch_facts(p: Parsed) -> None:
    """A micro-batch of one (batch_of_one): activations scale with the batch and are then at their least, so memory
    that still runs out is mostly the model state each rank holds. Read in the head and tail, as hints are; a batch
    size of evaluation or inference says nothing of the training step's."""
    for m in _BATCH_ONE.finditer(p.brief):
        before = p.brief[max(0, m.start() - 40):m.start()].rsplit("\n", 1)[-1]
        if not _NOT_TRAIN_BATCH.search(before):
            p.facts.add("batch_of_one")
            return


def _build_facts(p: Parsed, text: str) -> None:
    """What the paste shows of the build against the card: a CUDA release of 10.x or older named beside a GPU of
    the Ampere generation or newer (the build has no kernel image for the card)."""
    releases = []
    for m in _CUDA_RELEASE.finditer(text):
        if m.group(1):
            releases.append(int(m.group(1)))
        else:  # cu102 -> 10, cu92 -> 9, cu118 -> 11
            digits = m.group(2) or m.group(3)
            releases.append(int(digits[:-1]))
    if releases and max(releases) <= 10 and _AMPERE_OR_NEWER.search(text):
        p.facts.add("cuda_predates_gpu")


def gather_facts(p: Parsed, fact_patterns: dict[str, FactPattern]) -> None:
    """Add to `p.facts` (and the configuration fields of `p`) every fact its parsed text, lines, frames, exceptions,
    exit codes, signals and versions show; `fact_patterns` are the knowledge file's named patterns."""
    text = p.text
    _pattern_facts(p, fact_patterns)
    _launch_facts(p, text)
    _rank_fit_facts(p)
    _spawn_facts(p, text)
    _batch_facts(p)
    _model_facts(p, text)
    _vocab_facts(p, text)
    _collective_facts(p, text)
    _barrier_facts(p, text)
    _build_facts(p, text)
    _progress_facts(p)
    _outcome_facts(p)


def _pattern_facts(p: Parsed, fact_patterns: dict[str, FactPattern]) -> None:
    """The knowledge file's named facts: a symptom (sym_*) is searched in the head and tail of the log only. A
    pattern none of whose required words the squashed log holds is not run (literals.py: the same answer)."""
    hay = Haystack.of(p)
    for name, pat in fact_patterns.items():
        brief = name.startswith(SYMPTOM_PREFIX)
        regex = pat.pattern if isinstance(pat, LineFilter) else pat
        needles = regex.needles if isinstance(regex, Regex) else _needles(regex)
        if may_match(needles, hay.brief if brief else hay.text) and pat.search(p.brief if brief else p.text):
            p.facts.add(name)


@cache
def _needles(pattern: re.Pattern) -> tuple[str, ...] | None:
    """required_literals of a fact's pattern, read once per pattern in a process."""
    return required_literals(pattern)


def _launch_facts(p: Parsed, text: str) -> None:
    """How the job was launched: the ZeRO stage (from the config, the command line or DeepSpeed's frames) and the
    world size (one process, or several ranks)."""
    stages = []
    for m in _STAGE.finditer(text):
        groups = [g for g in m.groups() if g is not None]
        if m.group(0).lower().startswith("stage_1_and_2"):
            stages.append(2)
        elif groups and groups[0].isdigit() and int(groups[0]) <= 3:
            stages.append(int(groups[0]))
    if any("deepspeed/runtime/zero/stage3.py" in f or "partition_parameters.py" in f or "parameter_offload.py" in f
           for f in p.frames):
        stages.append(3)
    if stages:
        p.zero_stage = max(stages)
        p.facts.add(f"zero{p.zero_stage}")
    if p.zero_stage == 3:
        p.facts.add("zero3")
    worlds = [int(m.group(1)) for m in _WORLD.finditer(text)]
    if worlds:
        p.world_size = max(worlds)
        if p.world_size > 1:
            p.facts.add("multi_rank")
        elif p.world_size == 1:
            p.facts.add("one_rank")  # a launch of one process: any other holder of its GPU is not a rank of it


def _model_facts(p: Parsed, text: str) -> None:
    """How the model was loaded: its device_map (and whether it splits the model over GPUs), the training dtype and
    the model's size in billions of parameters."""
    m = re.search(r"(?:device_map\s*[=:]\s*|--device_map(_config(?:_path)?)?\s+)(['\"]?)(\{[^}\n]{0,80}\}|[\w:./-]+)\2",
                  text)
    if m:
        p.device_map = m.group(3)
        p.facts.add("device_map")
        # ms-swift's --device_map_config(_path) names a JSON that splits one model over several GPUs
        if m.group(1) or m.group(3).lower() in ("auto", "balanced", "balanced_low_0", "sequential"):
            p.facts.add("device_map_split")
    for dtype, pat in (("fp16", r"--fp16(?:\s+True)?\b|\bfp16\s*[:=]\s*true|\"fp16\":\s*\{\s*\"enabled\":\s*true|"
                                r"mixed_precision[\s=:'\"]*fp16|torch_dtype\s*=\s*torch\.float16|\.half\(\)|"
                                r"16-mixed|precision[\s=:'\"]*16\b|weight_dtype\s*=\s*torch\.float16"),
                       ("bf16", r"--bf16(?:\s+True)?\b|\bbf16\s*[:=]\s*true|mixed_precision[\s=:'\"]*bf16|"
                                r"torch_dtype\s*=\s*torch\.bfloat16")):
        if re.search(pat, text, re.I):
            p.dtype = p.dtype or dtype
            p.facts.add(dtype)
    sizes = [float(m.group(1)) for m in _MODEL_SIZE.finditer(text) if 0.1 <= float(m.group(1)) <= 700]
    if sizes:
        p.model_size_b = max(sizes)
        if p.model_size_b >= 30:
            p.facts.add("big_model")


# load_state_dict's size mismatch (torch/nn/modules/module.py, _load_from_state_dict: "size mismatch for {key}: copying
# a param with shape {ckpt} from checkpoint, the shape in current model is {model}.") on an embedding or output head
_VOCAB_ROWS = re.compile(r"size mismatch for [\w.]*(?:embed_tokens|wte|word_embeddings|lm_head|embed_out|output_layer)"
                         r"\.weight: copying a param with shape torch\.Size\(\[(\d+), (\d+)\]\) from checkpoint, the "
                         r"shape in current model is torch\.Size\(\[(\d+), (\d+)\]\)")


def _vocab_facts(p: Parsed, text: str) -> None:
    """vocab_rows_differ: an embedding or head of the checkpoint has as wide rows as the model's but another number of
    them: the vocabulary differs (a tokenizer or dictionary other than the checkpoint's, tokens added or a config's
    vocab_size edited), where a whole share of the rows (a half, a quarter) is a sharded copy of a tied head."""
    for m in _VOCAB_ROWS.finditer(text):
        ckpt, width, model, model_width = (int(x) for x in m.groups())
        if width != model_width or ckpt == model or not ckpt or not model:
            continue
        if max(ckpt, model) % min(ckpt, model):
            p.facts.add("vocab_rows_differ")
            return


def _progress_facts(p: Parsed) -> None:
    """Data preparation: a dataset progress bar that ran half an hour or more, or a paste that stops in one."""
    for line in p.lines:
        m = _ELAPSED.search(line)
        if m and _PROGRESS_DATA.search(line):
            h, mm, ss = (int(m.group(1)), int(m.group(2)), m.group(3))
            minutes = h * 60 + mm if ss is not None else h + mm / 60
            if minutes >= 29.5:
                p.facts.add("data_progress_30min")
    if _ends_in_data_prep(p.lines):
        p.facts.add("ends_in_data_prep")


def _outcome_facts(p: Parsed) -> None:
    """How the run ended, as the traceback and the launcher tell: an environment dump, exit codes and signals, the
    user's own call, a memory fault outside the compiled extensions, a cut traceback, a real exception."""
    if len(p.versions) >= 2:  # an environment dump: the report is about which versions were installed
        p.facts.add("versions_listed")
    for code in p.exit_codes:
        p.facts.add(f"exit{code}")
    for sig in p.signals:
        p.facts.add("sig_" + re.sub(r"\W+", "_", sig.strip().lower()))
    if _own_gc_call(p):
        p.facts.add("own_gc_call")
    if _own_call(p):
        p.facts.add("own_call")
    elif _library_kwarg_error(p):
        p.facts.add("library_kwarg_error")
    if _fault_outside_ext(p):
        p.facts.add("fault_outside_ext")
    if _unbound_in_library(p):
        p.facts.add("unbound_in_library")
    if p.cut_frames:
        p.facts.add("tb_cut")
    if p.exception:
        p.facts.add("has_exception")
        if p.exception.type not in WRAPPER_TYPES and not p.exception.type.endswith("Warning"):
            p.facts.add("real_exception")


def _ends_in_data_prep(lines: list[str]) -> bool:
    """The paste stops in a dataset preprocessing progress bar (tokenizing, map, packing), or in a data module's
    INFO lines (building an index, packing sequences), and shows no error after it: the job died or hung while one
    rank was still preparing data (the other ranks wait at a barrier)."""
    tail = [x for x in lines[-3:] if x.strip()]
    if not tail or _PROGRESS_BAR_STOP.search(tail[-1]):
        return False
    if len(tail) >= 2 and all(_DATA_LOG.search(x) and not _PROGRESS_BAR_STOP.search(x) for x in tail[-2:]):
        return True
    if not _PROGRESS_DATA.search(tail[-1]):
        return False
    return bool(re.search(r"[█▏▎▍▌▋▊▉#]{3}|\d+%\||\d+\s*/\s*\d+|examples/s|ba/s", tail[-1]))
