"""GPU specs: `8x24GB`, `4xA100-80G`, `2xH100`, `1x4090`; and detection of the local machine."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from shardfit.errors import UserError

# Usable memory in GiB as the driver reports it (nvidia-smi "total"), not the marketing number.
CARDS = {
    "4090": 23.6, "3090": 23.6, "3090ti": 23.6, "4080": 15.6, "3080": 9.8, "a6000": 47.5, "l40s": 44.5, "l40": 44.5,
    "l4": 22.0, "a10": 22.0, "a10g": 22.0, "t4": 14.6, "v100": 31.7, "v100-32g": 31.7, "v100-16g": 15.8,
    "a100": 79.2, "a100-40g": 39.4, "a100-80g": 79.2, "h100": 79.2, "h100-80g": 79.2, "h200": 139.8,
    "h20": 94.5, "a800": 79.2, "h800": 79.2, "b200": 178.0, "mi300x": 191.5, "5090": 31.4,
    "a40": 44.5, "a30": 23.5, "6000ada": 47.5, "4070ti": 11.6, "4060ti": 15.6, "2080ti": 10.6, "h100-94g": 93.1,
    "mi250x": 63.9, "titan": 23.6, "h100-pcie": 79.2, "h100-nvl": 93.1, "3090-nvlink": 23.6, "a6000-nvlink": 47.5,
    "h100-96g": 89.4,
}
# The memory each card is sold with (GB as the vendors write it, GiB of memory in fact): an integer size such as
# `8x24GB` names cards of that nominal size (`usable_gib`).
NOMINAL = {
    "4090": 24, "3090": 24, "3090ti": 24, "4080": 16, "3080": 10, "a6000": 48, "l40s": 48, "l40": 48, "l4": 24,
    "a10": 24, "a10g": 24, "t4": 16, "v100": 32, "v100-32g": 32, "v100-16g": 16, "a100": 80, "a100-40g": 40,
    "a100-80g": 80, "h100": 80, "h100-80g": 80, "h200": 141, "h20": 96, "a800": 80, "h800": 80, "b200": 192,
    "mi300x": 192, "5090": 32, "a40": 48, "a30": 24, "6000ada": 48, "4070ti": 12, "4060ti": 16, "2080ti": 11,
    "h100-94g": 94, "mi250x": 64, "titan": 24, "h100-pcie": 80, "h100-nvl": 94, "3090-nvlink": 24,
    "a6000-nvlink": 48, "h100-96g": 96,
}
# The share of a card's nominal memory PyTorch can allocate (torch.cuda.mem_get_info on an idle card: a 4090 23.65
# GiB of 24, an A100-80 79.2, a V100-16 15.8), the rest being the driver's and the ECC's.
USABLE_SHARE = 0.985
# Cards joined in pairs by an NVLink bridge (`2x3090-nvlink`): the bridge links two cards, no more.
BRIDGED = ("3090-nvlink", "a6000-nvlink")
# Form factors the table times apart from the card's SXM module (other memory, clocks and links).
FORM_FACTORS = ("pcie", "nvl")
# Cards sold with two memory sizes: the bare name means the larger one, and the plan says so.
AMBIGUOUS = {"a100": "A100 taken as the 80 GB card; write A100-40G for the 40 GB one",
             "v100": "V100 taken as the 32 GB card; write V100-16G for the 16 GB one"}
# Cards without bf16 arithmetic: bf16 is emulated or refused there, fp16 is what they compute in.
NO_BF16 = ("t4", "v100", "v100-32g", "v100-16g", "2080ti", "titan")
# More GPUs than any cluster holds: the planner's per-rank searches (a pipeline's stage counts divide the world)
# take time in the world size, so a typo of a few extra digits would hang `plan` (and the UI's plan request).
MAX_WORLD = 100_000
# More memory per GPU than any card holds (GiB): a size past it is a typo.
MAX_GPU_GIB = 4096
# A size-only spec (`24GB`, `24GiB`, `24G`, `24`), ASCII digits only.
SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(gb|gib|g)?", re.ASCII)


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float
    cpu_mem_gib: float | None = None
    name: str = ""
    # A CPU job's own matmul rates per rank (GFLOP/s, fp32 and bf16), measured by the process that trains:
    # the time model then uses them instead of cards.yaml's generic CPU row.
    cpu_fp32_gflops: float | None = None
    cpu_bf16_gflops: float | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def unit(self) -> str:
        """What one rank computes on, in words: a GPU, or on a CPU-only machine a process sharing the host RAM."""
        return "process" if self.name == "cpu" else "GPU"


def parse_gpus(spec: str, nodes: int = 1, cpu_mem_gib: float | None = None) -> Hardware:
    """Parse `NxMEM` or `NxCARD` (MEM like 24GB / 24GiB / 24G / 24)."""
    if re.search(r"[,+;&]", spec):  # the card table would read only the first card of `2xH100+2xA100`
        raise UserError(f"--gpus {spec}: one kind of GPU per plan (every rank of a job is planned alike): give "
                        f"every GPU of the job as its smallest card, e.g. --gpus {_total_count(spec)}xA100, or plan "
                        f"each kind apart.")
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(.+?)\s*", spec, re.ASCII)
    count, what = (int(m.group(1)), m.group(2)) if m else (1, spec.strip())
    key = card_key(what)
    size = SIZE.fullmatch(what.lower())
    if key in CARDS:  # before sizes: `1x4090` is a card, not 4090 GiB
        mem = CARDS[key]
    elif size:
        mem = usable_gib(size.group(1), size.group(2))
        if mem > MAX_GPU_GIB:
            raise UserError(f"--gpus {spec}: {what} is more memory than any GPU holds (at most {MAX_GPU_GIB} GiB); "
                            f"give the memory of one GPU, e.g. --gpus {count}x80GB.")
    else:
        raise UserError(f"--gpus {spec}: unknown card '{what}'. Known: {', '.join(sorted(CARDS))}; "
                        f"or give a size such as 8x24GB.")
    if count < 1 or mem <= 0:
        raise UserError(f"--gpus {spec}: need at least one GPU with positive memory.")
    check_world(nodes, count, f"--gpus {spec}")
    if key in BRIDGED and count != 2:
        bare = key.removesuffix("-nvlink")
        raise UserError(f"--gpus {spec}: an NVLink bridge joins exactly two cards: write 2x{key}, or {count}x{bare} "
                        f"(a ring over more cards than a bridge joins crosses host memory, as without one).")
    return Hardware(nodes, count, mem, cpu_mem_gib, what)


def usable_gib(size: str, unit: str | None = None) -> float:
    """The memory PyTorch can use on a card of `size` as a spec writes it: an integer in GB, G or bare (`24`) is
    the card's nominal size, the table's usable figure where every card sold with that size has the same one, else
    USABLE_SHARE of it; a size with decimals (`23.6`, `89.4`), or in the binary unit (`unit` gib: `24GiB`), is
    usable memory already."""
    if "." in size or unit == "gib":
        return float(size)
    nominal = int(size)
    known = {CARDS[key] for key, gb in NOMINAL.items() if gb == nominal}
    return known.pop() if len(known) == 1 else round(USABLE_SHARE * nominal, 2)


def size_note(hw: Hardware) -> str | None:
    """How a size-only spec's memory was read (`usable_gib`), for the plan's notes; None for a named card."""
    size = SIZE.fullmatch(hw.name.strip().lower())
    if size is None:
        return None
    if "." in size.group(1) or size.group(2) == "gib":
        return f"{hw.name} read as usable memory: {hw.gpu_mem_gib:g} GiB for PyTorch on each GPU"
    return (f"{hw.name} read as cards sold with {size.group(1)} GB: {hw.gpu_mem_gib:g} GiB usable by PyTorch on each; "
            f"write a size with decimals or in GiB (e.g. {size.group(1)}GiB) for exactly that much usable memory")


def _total_count(spec: str) -> int:
    """The GPUs a list of `NxCARD` names, all kinds together (1 for each part without a count)."""
    return sum(int(m.group(1)) if (m := re.match(r"\s*(\d+)\s*[xX*]", part)) else 1
               for part in re.split(r"[,+;&]", spec) if part.strip())


def check_world(nodes: int, per_node: int, what: str) -> None:
    """A UserError naming `what` when `nodes` x `per_node` ranks are more than MAX_WORLD."""
    if nodes * per_node > MAX_WORLD:
        raise UserError(f"{what}: {nodes} node(s) x {per_node} GPU(s) is {nodes * per_node:,} ranks, more than any "
                        f"cluster (the planner takes at most {MAX_WORLD:,}): check the count, and give --nodes and "
                        f"the GPUs of one node apart (e.g. --nodes 16 --gpus 8xH100).")


def card_key(name: str) -> str:
    """A card name as the table spells it: `NVIDIA GeForce RTX 3090` -> `3090`, `A100-80GB` -> `a100-80g`, and
    the driver's names (`NVIDIA H100 80GB HBM3` -> `h100-80g`, `NVIDIA A100-SXM4-40GB` -> `a100-40g`,
    `NVIDIA RTX 6000 Ada Generation` -> `6000ada`, `NVIDIA H100 PCIe` -> `h100-pcie`)."""
    key = name.lower()
    for word in ("nvidia", "geforce", "tesla", "rtx", "amd", "instinct", "pcie", "sxm"):
        key = key.replace(word, "")
    key = key.replace(" ", "").replace("_", "-").strip("-").replace("gb", "g")
    key = key if key in CARDS else _driver_name_key(name) or key
    words = re.findall(r"[a-z0-9]+", name.lower())
    for form in FORM_FACTORS:  # `NVIDIA H100 PCIe`, `H100-NVL`: the form factor's own row where there is one
        variant = f"{key.split('-')[0]}-{form}"
        if form in words and variant in CARDS:
            return variant
    return key


def _driver_name_key(name: str) -> str | None:
    """The table's card in a name that carries more words than the card's (form factor, memory type): the first
    word, or pair of adjacent words, that names a card, with the name's memory size where the table has that
    variant."""
    words = re.findall(r"[a-z0-9]+", name.lower())
    sizes = [m.group(1) for w in words if (m := re.fullmatch(r"(\d+)gb?", w))]
    for i, word in enumerate(words):
        for cand in (word + words[i + 1] if i + 1 < len(words) else None, word):
            if cand in CARDS and not re.fullmatch(r"\d+gb?", cand):
                sized = f"{cand}-{sizes[0]}g" if sizes else None
                return sized if sized in CARDS else cand
    return None


def hardware_notes(hw: Hardware, precision: str) -> list[str]:
    """What the plan assumed about the cards that a user may not have meant."""
    key = card_key(hw.name)
    notes = [AMBIGUOUS[key]] if key in AMBIGUOUS else []
    if key not in CARDS and (read := size_note(hw)):
        notes.append(read)
    if key in NO_BF16 and precision == "bf16":
        notes.append(f"{hw.name} has no bf16 arithmetic: train with precision fp16 there (same memory)")
    return notes


def host_mem_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def detect(nodes: int = 1) -> Hardware:
    """The local GPUs, or (no GPU) the CPU treated as one device with the host's memory."""
    import torch  # only to ask the driver: the rest of the planner runs without torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        check_world(nodes, n, f"--nodes {nodes}")
        props = torch.cuda.get_device_properties(0)
        return Hardware(nodes, n, props.total_memory / 2**30, host_mem_gib(), props.name)
    check_world(nodes, 1, f"--nodes {nodes}")
    return Hardware(nodes, 1, host_mem_gib() or 16.0, host_mem_gib(), "cpu")


def cards_here(hw: Hardware) -> bool:
    """Whether this machine has CUDA GPUs of `hw`'s kind: the same card (as the table keys it) or, for a size
    such as `8x24GB`, the same memory within 5 %. Imports torch, to ask the driver."""
    import torch

    if not torch.cuda.is_available():
        return False
    name = torch.cuda.get_device_name(0)
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    base = card_key(hw.name).split("-")[0]
    same_card = base not in CARDS or card_key(name).split("-")[0] == base  # a size names no card
    return same_card and abs(mem - hw.gpu_mem_gib) <= 0.05 * mem


def job_hardware(device_type: str, world: int, cpu_gflops: tuple[float, float] | None = None) -> Hardware:
    """The hardware of a running job of `world` ranks: its GPUs, or on a CPU machine the host RAM they share and,
    when given, each rank's measured (fp32, bf16) matmul GFLOP/s."""
    if device_type == "cuda":
        hw = detect()
        return Hardware(max(1, world // hw.gpus_per_node), min(hw.gpus_per_node, world), hw.gpu_mem_gib,
                        hw.cpu_mem_gib, hw.name)
    mem = host_mem_gib() or 16.0
    fp32, bf16 = cpu_gflops if cpu_gflops else (None, None)
    return Hardware(1, world, mem / world, mem, "cpu", fp32, bf16)
