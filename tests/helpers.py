"""Plain helpers the tests call: tiny real models, config files, the CLI in a subprocess. Fixtures that build
shared models live in conftest.py."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import wave
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)

ROOT = Path(__file__).resolve().parent.parent


def load_bench(name: str):  # noqa: ANN201 - a module
    """bench/<name>.py as a module (bench/ is scripts, not a package): what a test of a bench script calls."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
DEMO_DATA = ROOT / "src" / "shardfit" / "demo" / "train.jsonl"


def make_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama", tie: bool = True, seed: int = 0,
                    layers: int = 2) -> Path:
    """A randomly initialised tiny model of a real architecture, saved as an HF folder with the tokenizer."""
    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    return save_with_tokenizer(AutoModelForCausalLM.from_config(config), out, tokenizer_dir)


def save_with_tokenizer(model: torch.nn.Module, out: Path, tokenizer_dir: Path) -> Path:
    """`model` saved as an HF folder at `out`, with the bundled tokenizer's files beside it."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a test's rendezvous or store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """This spawned process as rank `rank` of a gloo group of `world` on 127.0.0.1 (its store on `port`, rank 0
    hosting it), computing on one thread as each rank of a real run does."""
    import datetime

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int, timeout_s: float = 60.0) -> Iterator[None]:
    """`join_gloo` for the length of the block, the group destroyed after it (also when the block raises). A block
    that ends normally ends the process too, with exit code 0: what a rank reports it has written inside the block.

    Why exit there: gloo's worker threads can still hold tensors when the interpreter finalizes, and freeing them
    then aborts the process (SIGABRT, "terminate called without an active exception") after its work is done and
    written, now and then on a loaded machine (CI met it twice; pytorch/pytorch#179291 describes the race)."""
    import torch.distributed as dist

    join_gloo(rank, world, port, timeout_s)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()  # rank 0 hosts the store: no rank leaves while another may still need it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_config(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m shardfit ...` in a subprocess, as a user runs it (`input`: what the user types)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "shardfit", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=full_env, input=input)


def train_here(config: Path, capsys: pytest.CaptureFixture | None = None) -> str:
    """`shardfit train CONFIG` on one process, in this one (the CLI's own `main`): a one-process run without the
    seconds a new interpreter spends importing torch and transformers. Returns what it printed to stdout when given
    the test's `capsys` (else its output stays in the test's captured output)."""
    from shardfit.cli.main import main

    if capsys is not None:
        capsys.readouterr()
    assert main(["train", str(config)]) == 0, f"shardfit train {config} failed: its output is above"
    return capsys.readouterr().out if capsys is not None else ""


def run_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """`shardfit ARGS` through the CLI's own `main` in this process: (exit code, stdout, stderr), without a new
    interpreter's start-up. For commands whose process is not what a test is about (an unexpected exception is the
    last guard's exit 1 and message there too)."""
    from shardfit.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def saved_tensor_bytes(module: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes autograd keeps for backward while `forward()` runs `module` (saved-tensor hooks), each storage once,
    the module's own parameters left out: what the planner's activation estimates model."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())


def freeze_block_linears(model: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module]) -> None:
    """Swap every plain nn.Linear of the decoder blocks (`model.model.layers`) for `make(linear)`, a stand-in for a
    quantized layer, holding the linear's own weight and bias frozen."""
    for module in list(model.model.layers.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                frozen = make(child)
                frozen.weight = torch.nn.Parameter(child.weight.data.clone(), requires_grad=False)
                if child.bias is not None:
                    frozen.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(module, name, frozen)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tiny_omni_config(vocab_size: int = 49152, **thinker):
    """A Qwen2.5-Omni config shrunk in every part (thinker text/vision/audio, talker, token2wav); `thinker`: more
    thinker config keys (its media token ids)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=2, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0])
    audio = dict(encoder_layers=1, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=32)
    talker = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, embedding_size=32, head_dim=8, rope_parameters=rope)
    dit = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ff_mult=1, emb_dim=16, head_dim=16,
               enc_emb_dim=16, enc_dim=32, enc_channels=[32, 32, 32, 32, 64], enc_attention_channels=16,
               enc_se_channels=16, num_embeds=64, mel_dim=16, repeats=2)
    bigvgan = dict(mel_dim=16, upsample_initial_channel=32, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                   resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]])
    return Qwen2_5OmniConfig(thinker_config=dict(text_config=text, vision_config=vision, audio_config=audio,
                                                 **thinker),
                             talker_config=talker, token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))


def make_run(path: Path, *, mem: list[list[float]], predicted: float, strategy: str = "zero3",
             losses: tuple[float, ...] = (2.0, 1.6, 1.3, 1.1)) -> Path:
    """A run directory as training writes it (config, plan, preflight, metrics, summary), with chosen numbers."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"model": "tiny", "method": "lora", "strategy": strategy}))
    cands = [{"strategy": s, "fits": True, "per_gpu_gib": {"total": predicted if s == strategy else predicted * 2},
              "peak_phase": "backward", "notes": f"notes of {s}"} for s in ("ddp", strategy)]
    (path / "plan.json").write_text(json.dumps({"model": {"id": "tiny", "params": 1000, "trainable_params": 10},
                                                "hardware": {"nodes": 1, "gpus_per_node": len(mem[0]),
                                                             "gpu_mem_gib": 24.0},
                                                "candidates": cands, "recommended": strategy}))
    (path / "preflight.json").write_text(json.dumps({"strategy": strategy, "ok": True, "findings": [
        {"rule": "device_map_in_distributed", "severity": "warning", "where": "model", "message": "ignored",
         "fix": "remove device_map", "auto_fixed": True}]}))
    lines = []
    for i, (loss, m) in enumerate(zip(losses, mem, strict=True), start=1):
        lines.append({"step": i, "epoch": i / 4, "loss": loss, "lr": 1e-3 / i, "grad_norm": 0.5 + i / 10,
                      "tokens": 100 * i, "tokens_per_s": 1000.0 + i, "mem_gib": m, "wall_s": float(i)})
        if i % 2 == 0:
            lines.append({"step": i, "eval_loss": loss + 0.1, "eval_exact": i / 8})
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (path / "summary.json").write_text(json.dumps({"steps": 4, "train_loss": losses[-1], "eval_loss": 1.2,
                                                   "tokens_per_s": 1003.5, "peak_mem_gib": mem[-1], "wall_s": 4.0,
                                                   "strategy": strategy, "world_size": len(mem[0]),
                                                   "eval_exact": 0.5}))
    return path


BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def browser() -> str | None:
    """A headless-capable Chromium on PATH (Debian: apt-get install chromium-headless-shell), or None."""
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


def browser_dom(url: str) -> str:
    """The page's DOM after a real headless browser loaded and rendered it."""
    cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def make_tiny_vl(out: Path, tokenizer_dir: Path, arch: str = "qwen2_vl", seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen2-VL (or Qwen2.5-VL) saved as an HF folder: the SmolLM2 tokenizer with the
    vision tokens added, and a PIL image processor capped at 112x112 pixels (at most 16 image tokens)."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(VL_TOKENS)})
    start, end, image, video = tok.convert_tokens_to_ids(list(VL_TOKENS))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rope_parameters=rope, pad_token_id=2,
                bos_token_id=1, eos_token_id=2)
    ids = dict(image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    if arch == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).save_pretrained(out)
    return out


OMNI_TOKENS = ("<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>", "<|audio_bos|>",
               "<|audio_eos|>")


def make_tiny_omni(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen2.5-Omni saved as an HF folder that trains on media: the SmolLM2 tokenizer
    with Omni's media tokens added (their ids in the thinker config), and a preprocessor_config.json holding a
    small-image processor (at most 112x112 pixels) and a Whisper feature extractor (128 mel bins)."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(OMNI_TOKENS)})
    start, end, image, video, audio, audio_bos, audio_eos = tok.convert_tokens_to_ids(list(OMNI_TOKENS))
    config = tiny_omni_config(len(tok), image_token_index=image, video_token_index=video, audio_token_index=audio,
                              audio_start_token_id=audio_bos, audio_end_token_id=audio_eos,
                              vision_start_token_id=start, vision_end_token_id=end)
    Qwen2_5OmniForConditionalGeneration(config).save_pretrained(out)
    torch.save({}, out / "spk_dict.pt")  # real Omni checkpoints ship spk_dict.pt; its loader requires one
    tok.save_pretrained(out)
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).to_dict()
    (out / "preprocessor_config.json").write_text(json.dumps({**images, **WhisperFeatureExtractor(
        feature_size=128).to_dict()}, indent=2))
    return out


def write_wav(path: Path, seconds: float, freq: float = 440.0, rate: int = 16000, channels: int = 1) -> Path:
    """A 16-bit PCM WAV file of a sine wave, written with the standard library."""
    t = np.arange(int(seconds * rate)) / rate
    x = (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(x[:, None], channels, axis=1).tobytes())
    return path


def write_images(folder: Path, colours: dict[str, tuple[int, int, int]], size: tuple[int, int] = (56, 56)) -> None:
    """Solid-colour PNGs named NAME.png, generated with PIL."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rgb in colours.items():
        Image.new("RGB", size, rgb).save(folder / f"{name}.png")


def saved_storage_bytes(model: torch.nn.Module, run: Callable[[torch.nn.Module], object],
                        *contexts: contextlib.AbstractContextManager) -> int:
    """Bytes of the unique storages autograd keeps for backward after `run(module)`, where `module` is the training
    module (train/loss.py `CausalLMLoss`, every row labelled) around `model` built on the meta device: what the
    planner's activation terms count. On fake tensors (`run` makes its inputs inside the fake mode), so nothing is
    computed; weights are excluded; `contexts` (autocast, a kernel choice) are entered around the forward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardfit.train.loss import CausalLMLoss

    kept: dict[int, int] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        module = CausalLMLoss(model, all_labelled=True)
        weights = {p.untyped_storage()._cdata for p in module.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in weights:
                kept[storage._cdata] = storage.nbytes()
            return t

        with contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            run(module)
    return sum(kept.values())


def likely_categories(log: str) -> list[str]:
    """The categories `shardfit diagnose` ranks for a paste, best first (the diagnose tests' one reading of it)."""
    from shardfit.diagnose.engine import analyze

    return [x.category for x in analyze(log).likely]


def ranked_causes(log: str) -> list[str]:
    """The categories `diagnose` names for a paste, confident or not, best first."""
    from shardfit.diagnose.engine import analyze

    return [x.category for x in analyze(log).likely]


def parsed_facts(log: str) -> set[str]:
    """The facts `diagnose` reads in a paste, before any rule weighs them."""
    from shardfit.diagnose.engine import analyze

    return analyze(log).parsed.facts
