"""The cache of GGUF models converted to Hugging Face folders (models/gguf_cache.py), on a tiny GGUF written here
with the `gguf` package: hits read no GGUF, loads are bitwise those of the GGUF itself, and a changed file, a broken
entry, the off switch and racing processes all end in the right weights."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import yaml

from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.models import gguf_cache
from shardfit.models.build import build_model, load_tokenizer, weights_cached
from shardfit.models.source import resolve_model
from tests.helpers import ROOT, train_here, write_config

Q4_1, Q8_0, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character table: the 256 base tokens of a byte-level BPE vocabulary."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def make_tiny_gguf(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2, ffn: int = 128,
                   metadata: dict[str, str] | None = None) -> Path:
    """A Llama GGUF as llama.cpp writes one (SmolLM2's metadata keys, Q4_1 blocks, a Q8_0 embedding, a byte-level
    BPE tokenizer with a chat template), 260 tokens and two layers; `metadata`: more string keys (general.source...)."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_chars(), "Ġt"]
    heads, kv = 2, 1
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for key, value in (metadata or {}).items():
        w.add_string(key, value)

    def tensor(name: str, shape: tuple[int, ...], kind: gguf.GGMLQuantizationType = Q4_1) -> None:
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if kind == F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    tensor("token_embd.weight", (len(tokens), hidden), Q8_0)
    head = hidden // heads
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), F32)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), F32)
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden))
        tensor(f"blk.{i}.attn_k.weight", (kv * head, hidden))
        tensor(f"blk.{i}.attn_v.weight", (kv * head, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    tensor("output_norm.weight", (hidden,), F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    (tmp_path / "models").mkdir()
    return make_tiny_gguf(tmp_path / "models" / "tiny.gguf")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own model cache."""
    where = tmp_path / "cache"
    monkeypatch.setenv(gguf_cache.ENV, str(where))
    return where


def _weights(model_path: Path, precision: str = "fp32") -> dict[str, torch.Tensor]:
    method = "full" if precision == "fp32" else "freeze"  # full fine-tunes keep fp32 master weights
    cfg = Config(model=str(model_path), method=method, precision=precision, freeze_trainable=["model.norm"])
    model = build_model(cfg, "single", weights=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _scramble_keeping_identity(path: Path) -> None:
    """Overwrite the file with zeros, keeping its size and mtime: only a load that never reads it still works."""
    st = path.stat()
    path.write_bytes(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _parts(cache: Path) -> list[Path]:
    return sorted(p for entry in cache.iterdir() if entry.is_dir() for p in entry.iterdir() if p.is_dir())


def test_a_second_load_reads_the_cache_and_matches_the_gguf_bitwise(tiny_gguf: Path, cache: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gguf_cache.ENV, "0")
    direct = {p: _weights(tiny_gguf, p) for p in ("fp32", "bf16")}
    direct_tok = load_tokenizer(resolve_model(str(tiny_gguf)))
    assert not cache.exists()  # off means off: nothing written

    monkeypatch.setenv(gguf_cache.ENV, str(cache))
    first = {p: _weights(tiny_gguf, p) for p in ("fp32", "bf16")}
    assert [p.name for p in _parts(cache)] == ["meta", "weights-bfloat16", "weights-float32"]
    _scramble_keeping_identity(tiny_gguf)  # from here on, parsing the GGUF would fail
    again = {p: _weights(tiny_gguf, p) for p in ("fp32", "bf16")}
    tok = load_tokenizer(resolve_model(str(tiny_gguf)))
    for p in ("fp32", "bf16"):
        assert _equal(direct[p], first[p]) and _equal(first[p], again[p]), p
    text = "hello tt"
    assert tok(text)["input_ids"] == direct_tok(text)["input_ids"]
    assert tok.chat_template == direct_tok.chat_template and tok.pad_token_id == direct_tok.pad_token_id


def test_a_changed_gguf_is_converted_again(tiny_gguf: Path, cache: Path) -> None:
    old = _weights(tiny_gguf)
    make_tiny_gguf(tiny_gguf, seed=1)  # the same path and size, new weights and mtime
    os.utime(tiny_gguf, ns=(time.time_ns(), tiny_gguf.stat().st_mtime_ns + 10**9))
    new = _weights(tiny_gguf)
    assert not _equal(old, new)
    assert len([e for e in cache.iterdir() if e.is_dir()]) == 2
    gguf_cache.KEEP, keep = 1, gguf_cache.KEEP
    try:  # a third file's entry pushes the oldest out
        other = make_tiny_gguf(tiny_gguf.with_name("other.gguf"), seed=2)
        _weights(other)
    finally:
        gguf_cache.KEEP = keep
    assert len([e for e in cache.iterdir() if e.is_dir() and not e.name.startswith(".")]) == 1


@pytest.mark.parametrize("damage", ["truncated", "no_manifest", "empty_folder"])
def test_a_broken_entry_is_rebuilt(tiny_gguf: Path, cache: Path, damage: str) -> None:
    good = _weights(tiny_gguf)
    part = next(p for p in _parts(cache) if p.name.startswith("weights"))
    if damage == "truncated":
        blob = part / "model.safetensors"
        blob.write_bytes(blob.read_bytes()[:1000])
    elif damage == "no_manifest":
        (part / gguf_cache.MANIFEST).unlink()
    else:
        for f in part.iterdir():
            f.unlink()
    assert not gguf_cache.is_complete(part)
    assert _equal(good, _weights(tiny_gguf))
    assert gguf_cache.is_complete(part)


def test_an_unwritable_cache_falls_back_to_the_gguf(tiny_gguf: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv(gguf_cache.ENV, str(blocker / "cache"))
    assert len(_weights(tiny_gguf)) > 0
    assert len(load_tokenizer(resolve_model(str(tiny_gguf)))) == 260


def test_a_bad_gguf_is_bad_input_not_a_traceback(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UserError, match="bad.gguf"):
        load_tokenizer(resolve_model(str(bad)))
    assert not (cache.exists() and _parts(cache))  # nothing half converted left behind


def test_threads_racing_convert_once(tmp_path: Path, cache: Path) -> None:
    """The lock: of four loaders of one missing part, one converts and the others read its folder."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"stand-in")
    source = resolve_model(str(model))
    calls: list[int] = []

    def convert(out: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        (out / "weights.bin").write_bytes(b"x" * 100)

    found: list[Path | None] = []
    threads = [threading.Thread(target=lambda: found.append(gguf_cache.cached_part(source, "p", convert)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(found)) == 1 and found[0] is not None
    assert gguf_cache.is_complete(found[0])


RACER = """
import hashlib, sys
from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.models.build import build_model
m = build_model(Config(model=sys.argv[1], method="full", precision="fp32"), "single", weights=True)
h = hashlib.sha256()
for k, v in sorted(m.state_dict().items()):
    h.update(k.encode()); h.update(v.contiguous().numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_two_processes_racing_produce_one_valid_entry(tiny_gguf: Path, cache: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **{gguf_cache.ENV: str(cache)})
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tiny_gguf)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    digests = {o[0].strip().splitlines()[-1] for o in outs}
    h = hashlib.sha256()
    for k, v in sorted(_weights(tiny_gguf).items()):
        h.update(k.encode())
        h.update(v.contiguous().numpy().tobytes())
    assert digests == {h.hexdigest()}
    parts = _parts(cache)
    assert [p.name for p in parts] == ["meta", "weights-float32"]
    assert all(gguf_cache.is_complete(p) for p in parts)
    leftovers = [p.name for e in cache.iterdir() if e.is_dir() for p in e.iterdir() if p.name.startswith(".") and
                 p.is_dir()]
    assert leftovers == []


def test_weights_cached_says_what_the_next_load_does(tiny_gguf: Path, cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config(model=str(tiny_gguf), method="full", precision="fp32")
    assert weights_cached(cfg) is False
    _weights(tiny_gguf)
    assert weights_cached(cfg) is True
    assert weights_cached(Config(model=str(tiny_gguf), method="lora", precision="bf16")) is False  # another dtype
    monkeypatch.setenv(gguf_cache.ENV, "off")
    assert weights_cached(cfg) is None


@pytest.mark.slow
def test_a_training_run_records_the_cache_and_names_the_gguf(tiny_gguf: Path, cache: Path, tmp_path: Path,
                                                             small_data: Path) -> None:
    _weights(tiny_gguf)  # a first run converted it
    cfg = write_config(tmp_path / "run.yaml", model=str(tiny_gguf), data=str(small_data), method="lora",
                       precision="fp32", max_seq_len=512, micro_batch=1, max_steps=1, save_steps=100,
                       output_dir=str(tmp_path / "run"))
    train_here(cfg)  # one process: the CLI's `main` here, the `cache` fixture's cache in its environment
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model_cache_hit"] is True and "model (cached)" in summary["startup_s"]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"] == str(tiny_gguf)
