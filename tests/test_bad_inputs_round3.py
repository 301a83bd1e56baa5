"""Issue 48, round three of hostile and damaged inputs: memory bombs in media files, damaged run directories,
`--from` files that are binary, nested thousands deep or typed wrong, damaged adapters, an endless stdin, the UI's
malformed requests and out-of-range form values, and a disk that fills during a checkpoint. Each ends in the
documented exit code and a message naming the file, key or row, never a traceback; the media bombs also in
bounded memory (measured in a subprocess where the margin is wide)."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import wave
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from shardfit.cli.main import main
from tests.helpers import ROOT, write_config

Case = tuple[str, Callable[[Path], list[str]], int, str]


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.err + out.out


def png(path: Path, width: int, height: int, data: bool = True, bilevel: bool = False) -> Path:
    """A valid PNG of one colour (RGB, or one bit per pixel), written row by row (an 11000x11000 one is 20 KB
    and costs no memory to make); `data=False`: the header alone claims the size (a decompression bomb's)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    z = zlib.compressobj(1)
    row = b"\0" + (bytes(-(-width // 8)) if bilevel else bytes([200, 30, 90]) * width)
    pixels = b"".join(z.compress(row) for _ in range(height if data else 1)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, *((1, 0) if bilevel else (8, 2)), 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path


def wav(path: Path, rate: int, frames: int, channels: int = 1) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.sin(np.arange(frames * channels) / 7) * 3000).astype(np.int16).tobytes())
    return path


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_vl: Path, small_data: Path) -> Path:
    """A workspace: the tiny text and vision-language models, good data, and the hostile files."""
    from PIL import Image

    root = tmp_path_factory.mktemp("round3")
    shutil.copy(small_data, root / "data.jsonl")
    (root / "media").mkdir()
    png(root / "media" / "huge.png", 11000, 11000, bilevel=True)  # tens of KB on disk, 363 MB decoded as RGB
    png(root / "media" / "bomb.png", 60000, 60000, data=False)  # PIL's DecompressionBombError
    Image.new("RGB", (3000, 8), (10, 200, 30)).save(root / "media" / "slim.png")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(buf, "JPEG")
    (root / "media" / "cut.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    wav(root / "media" / "8hz.wav", 8, 50_000)  # 100 KB "at 8 Hz": 1.7 hours, resampled whole 1.2 GiB
    (root / "tiny_llama").symlink_to(tiny_llama)
    (root / "tiny_vl").symlink_to(tiny_vl)
    return root


def _cfg(ws: Path, name: str, model: str = "tiny_llama", **keys: object) -> Path:
    base = dict(model=str(ws / model), data=str(ws / "data.jsonl"), precision="fp32", max_seq_len=256,
                micro_batch=1, max_steps=1, output_dir=str(ws / "runs" / name))
    base.update(keys)
    return write_config(ws / f"{name}.yaml", **base)


# ---- 1. media: memory bombs and misleading messages ---------------------------------------------------------------

def _media_row(ws: Path, name: str, image: str | None = None, audio: str | None = None) -> Path:
    turn = ("<image>" if image else "<audio>") + "What is it?"
    row: dict = {"messages": [{"role": "user", "content": turn}, {"role": "assistant", "content": "a thing"}]}
    if image:
        row["images"] = [f"media/{image}"]
    if audio:
        row["audios"] = [f"media/{audio}"]
    path = ws / f"{name}.jsonl"
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(plain) + "\n" + json.dumps(row) + "\n")
    return path


def _media_case(command: str, name: str, model: str, want: str, image: str | None = None,
                audio: str | None = None) -> Case:
    def build(ws: Path) -> list[str]:
        return [command, str(_cfg(ws, name, model, data=str(_media_row(ws, name, image, audio))))]
    return (f"{command} {name}", build, 2, want)


MEDIA_CASES: list[Case] = [
    _media_case("check", "png-11000", "tiny_llama", "huge.png is 11000x11000 pixels", image="huge.png"),
    _media_case("train", "png-11000", "tiny_llama", "huge.png is 11000x11000 pixels", image="huge.png"),
    _media_case("check", "png-60000", "tiny_llama", "more pixels than can be decoded safely", image="bomb.png"),
    _media_case("train", "png-60000", "tiny_vl", "more pixels than can be decoded safely", image="bomb.png"),
    _media_case("check", "jpeg-cut", "tiny_vl", "cut.jpg cannot be read (OSError: image file is truncated",
                image="cut.jpg"),
    _media_case("check", "slim-3000x8", "tiny_vl", "slim.png (3000x8 pixels): the model's image processor refuses "
                "it (absolute aspect ratio", image="slim.png"),
    _media_case("check", "wav-8hz", "tiny_llama", "8hz.wav: its header says 8 samples per second", audio="8hz.wav"),
    ("chat --image 60000x60000", lambda ws: ["chat", str(ws / "tiny_vl"), "--image", str(ws / "media" / "bomb.png"),
                                             "--prompt", "hi"], 2, "--image"),
    ("chat --image 11000x11000", lambda ws: ["chat", str(ws / "tiny_vl"), "--image", str(ws / "media" / "huge.png"),
                                             "--prompt", "hi"], 2, "11000x11000 pixels"),
    ("chat --image 3000x8", lambda ws: ["chat", str(ws / "tiny_vl"), "--image", str(ws / "media" / "slim.png"),
                                        "--prompt", "hi", "--max-new-tokens", "2"], 2, "absolute aspect ratio"),
]

# ---- 2. run directories that report reads -------------------------------------------------------------------------

GOOD_LINE = {"step": 1, "loss": 2.0, "lr": 1e-3, "mem_gib": [1.0]}


def _report_case(name: str, files: dict[str, str | bytes], want: str) -> Case:
    def build(ws: Path) -> list[str]:
        run = ws / "report-runs" / name
        run.mkdir(parents=True, exist_ok=True)
        full = {"metrics.jsonl": json.dumps(GOOD_LINE) + "\n", "summary.json": json.dumps({"steps": 1}),
                "config.yaml": "model: tiny\n", **files}
        for file, content in full.items():
            (run / file).write_bytes(content if isinstance(content, bytes) else content.encode())
        return ["report", str(run)]
    return (f"report {name}", build, 2, want)


REPORT_CASES: list[Case] = [
    _report_case("metrics-list", {"metrics.jsonl": "[1, 2]\n"}, "metrics.jsonl:1: 'the line' is [1, 2]"),
    _report_case("metrics-loss-text", {"metrics.jsonl": json.dumps({"step": 1, "loss": "abc"}) + "\n"},
                 "'loss' is 'abc'; expected a number"),
    _report_case("metrics-no-step", {"metrics.jsonl": json.dumps({"loss": 1.0}) + "\n"}, "'step'"),
    _report_case("metrics-mem-text", {"metrics.jsonl": json.dumps({"step": 1, "loss": 1.0, "mem_gib": "x"}) + "\n"},
                 "'mem_gib'"),
    _report_case("metrics-latin1", {"metrics.jsonl": '{"step": 1, "note": "caf\xe9"}\n'.encode("latin-1")},
                 "not UTF-8"),
    _report_case("summary-list", {"summary.json": "[1]"}, "summary.json: 'the file' is [1]"),
    _report_case("summary-peak-text", {"summary.json": json.dumps({"peak_mem_gib": "lots"})}, "'peak_mem_gib'"),
    _report_case("summary-world-text", {"summary.json": json.dumps({"world_size": "two"})}, "'world_size'"),
    _report_case("plan-candidates-dict", {"plan.json": json.dumps({"candidates": {"a": 1}})}, "'candidates'"),
    _report_case("plan-no-total", {"plan.json": json.dumps({"candidates": [{"strategy": "ddp"}]})},
                 "candidates[0]: 'per_gpu_gib'"),
    _report_case("plan-deep", {"plan.json": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
    _report_case("preflight-findings-text", {"preflight.json": json.dumps({"findings": "none"})}, "'findings'"),
    _report_case("eval-models-list", {"eval.json": json.dumps({"models": [1]})}, "'models'"),
    _report_case("config-yaml-syntax", {"config.yaml": "model: [unclosed\n"}, "config.yaml:2: not valid YAML"),
    _report_case("config-yaml-list", {"config.yaml": "- a\n- b\n"}, "expected a mapping of config keys"),
    _report_case("config-yaml-deep", {"config.yaml": "a: " + "[" * 5000 + "]" * 5000 + "\n"}, "nested more than 64"),
    _report_case("config-yaml-latin1", {"config.yaml": "model: caf\xe9\n".encode("latin-1")}, "not UTF-8"),
]

# ---- 3. other tools' files (--from) and deep configs -------------------------------------------------------------

LF = "model_name_or_path: meta-llama/Llama-3.1-8B\nfinetuning_type: lora\n"


def _from_case(name: str, tool: str, file: str, content: str | bytes, want: str, command: str = "plan",
               extra: tuple[str, ...] = ()) -> Case:
    def build(ws: Path) -> list[str]:
        path = ws / "from" / file
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        gpus = ["--gpus", "1x80GB"] if command == "plan" else []
        return [command, "--from", tool, str(path), *gpus, *extra]
    return (f"{command} --from {tool} {name}", build, 2, want)


FROM_CASES: list[Case] = [
    _from_case("latin-1", "llamafactory", "l1.yaml", "model_name_or_path: caf\xe9\n".encode("latin-1"),
               "not UTF-8"),
    _from_case("latin-1", "axolotl", "a1.yaml", "base_model: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    _from_case("latin-1", "hf", "h1.json", '{"model_name_or_path": "caf\xe9"}'.encode("latin-1"), "not UTF-8"),
    _from_case("latin-1", "swift", "s1.sh", "swift sft --model caf\xe9\n".encode("latin-1"), "not UTF-8"),
    _from_case("gzip", "llamafactory", "gz.yaml", b"\x1f\x8b\x08\x00\xff\xfe", "not UTF-8"),
    _from_case("deep yaml", "llamafactory", "deep.yaml", LF + "x: " + "[" * 5000 + "]" * 5000 + "\n",
               "nested more than 64 levels"),
    _from_case("deep yaml", "axolotl", "deep-ax.yaml", "base_model: m\nx:\n" + "".join(
        "  " * i + "- \n" for i in range(1, 3000)), "nested more than 64 levels"),
    _from_case("deep json", "hf", "deep.json", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    _from_case("deep json", "deepspeed", "deep-ds.json", "[" * 100_000 + "]" * 100_000, "nested too deeply",
               extra=("--model", "meta-llama/Llama-3.1-8B")),
    _from_case("learning_rate text", "llamafactory", "lr.yaml", LF + "learning_rate: abc\n",
               "'learning_rate' is 'abc'"),
    _from_case("learning_rate text", "llamafactory", "lr-check.yaml", LF + "learning_rate: abc\n",
               "'learning_rate' is 'abc'", command="convert"),
    _from_case("max_steps text", "llamafactory", "ms.yaml", LF + "max_steps: many\n", "'max_steps' is 'many'"),
    _from_case("bf16 maybe", "llamafactory", "bf.yaml", LF + "bf16: maybe\n", "'bf16' is 'maybe'"),
    _from_case("bf16 a list", "llamafactory", "bl.yaml", LF + "bf16: [1]\n", "'bf16' is [1]"),
    _from_case("cutoff_len a mapping", "llamafactory", "cl.yaml", LF + "cutoff_len: {a: 1}\n", "'cutoff_len'"),
    _from_case("learning_rate text", "hf", "lr.json", json.dumps({"model_name_or_path": "meta-llama/Llama-3.1-8B",
                                                                  "learning_rate": "abc"}), "'learning_rate'"),
    _from_case("use_lora maybe", "hf", "ul.json", json.dumps({"model_name_or_path": "meta-llama/Llama-3.1-8B",
                                                              "use_lora": "maybe"}), "'use_lora' is 'maybe'"),
    _from_case("sequence_len a mapping", "axolotl", "sl.yaml", "base_model: meta-llama/Llama-3.1-8B\n"
               "sequence_len: {a: 1}\n", "'sequence_len'"),
    _from_case("load_in_4bit maybe", "axolotl", "l4.yaml", "base_model: meta-llama/Llama-3.1-8B\n"
               "load_in_4bit: maybe\n", "'load_in_4bit'"),
    ("train config nested deep", lambda ws: ["train", str(_deep_config(ws))], 2, "nested more than 64 levels"),
    ("check config nested deep", lambda ws: ["check", str(_deep_config(ws))], 2, "nested more than 64 levels"),
]


def _deep_config(ws: Path) -> Path:
    path = ws / "deep-config.yaml"
    path.write_text(f"model: {ws / 'tiny_llama'}\ndata: {ws / 'data.jsonl'}\nlora:\n  targets: "
                    + "[" * 5000 + "]" * 5000 + "\n")
    return path


# ---- 4. damaged adapters, export --out, an endless stdin ---------------------------------------------------------

def _run_with_adapter(ws: Path, name: str, damage: Callable[[Path], None]) -> Path:
    """A run directory with the LoRA adapter peft writes for the tiny model, then damaged."""
    run = ws / "adapter-runs" / name
    if run.exists():
        return run
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(ws / "tiny_llama"),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(run / "adapter")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": str(ws / "tiny_llama"), "method": "lora",
                                                     "precision": "fp32"}))
    damage(run / "adapter")
    return run


def _truncate(adapter: Path) -> None:
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _garbage_config(adapter: Path) -> None:
    (adapter / "adapter_config.json").write_text("{not json")


def _a_file(ws: Path) -> str:
    path = ws / "a-file.bin"
    path.write_bytes(b"x")
    return str(path)


class _Endless(io.RawIOBase):
    """stdin that never ends (`yes | shardfit diagnose -`)."""

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        line = b"RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        for i in range(0, len(b), len(line)):
            piece = line[: len(b) - i]
            b[i:i + len(piece)] = piece
        return len(b)


RUN_CASES: list[Case] = [
    ("chat on a truncated adapter", lambda ws: ["chat", str(_run_with_adapter(ws, "cut", _truncate)), "--prompt",
                                                "hi"], 2, "not an adapter of"),
    ("eval on a truncated adapter", lambda ws: ["eval", str(_run_with_adapter(ws, "cut", _truncate)), "--data",
                                                str(ws / "data.jsonl")], 2, "not an adapter of"),
    ("export --merge a truncated adapter", lambda ws: ["export", str(_run_with_adapter(ws, "cut", _truncate)),
                                                       "--merge", "--out", str(ws / "merged-cut")], 2,
     "not an adapter of this run's model"),
    ("chat on an adapter folder with a garbage config",
     lambda ws: ["chat", str(_run_with_adapter(ws, "garbage", _garbage_config) / "adapter"), "--prompt", "hi"], 2,
     "not a readable adapter_config.json"),
    ("export --out an existing file", lambda ws: ["export", str(_run_with_adapter(ws, "ok", lambda a: None)),
                                                  "--out", _a_file(ws)], 2, "is a file; name a folder"),
    ("export --merge --out an existing file", lambda ws: ["export", str(_run_with_adapter(ws, "ok", lambda a: None)),
                                                          "--merge", "--out", _a_file(ws)], 2, "is a file"),
    ("export --base --out an existing file", lambda ws: ["export", "--base", str(ws / "tiny_llama"), "--out",
                                                         _a_file(ws)], 2, "is a file"),
    ("export a run whose config.yaml is binary", lambda ws: ["export", str(_binary_config_run(ws)), "--merge"], 2,
     "not UTF-8"),
]


def _binary_config_run(ws: Path) -> Path:
    run = ws / "binary-config-run"
    run.mkdir(exist_ok=True)
    (run / "config.yaml").write_bytes(b"\x1f\x8b\x08\x00\xff\xfe\xfd")
    return run


CASES: list[Case] = MEDIA_CASES + REPORT_CASES + FROM_CASES + RUN_CASES


def test_there_are_at_least_50_cases() -> None:
    assert len(CASES) >= 50, len(CASES)


@pytest.mark.parametrize(("name", "build", "code", "want"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_message_not_a_traceback(ws: Path, capsys: pytest.CaptureFixture, name: str,
                                                build: Callable[[Path], list[str]], code: int, want: str) -> None:
    got, text = _run(build(ws), capsys)
    assert "Traceback" not in text, text[-3000:]
    assert "unexpected" not in text, text[-3000:]  # the last guard's message: a case nothing handled
    assert "chat template refuses" not in text, text[-3000:]  # the misleading message of the probe
    assert got == code, text[-3000:]
    assert want in text, text[-3000:]


def test_endless_stdin_to_diagnose_is_cut_and_said(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(_Endless())))
    start = time.monotonic()
    code, text = _run(["diagnose", "-"], capsys)
    assert code == 0 and "stopped reading stdin after 256 MiB" in text, text[-2000:]
    assert "out of memory" in text.lower()  # the log was still diagnosed
    assert time.monotonic() - start < 60


# ---- 5. bounded memory, and the same pixels and samples -----------------------------------------------------------

def test_an_image_shrunk_before_the_processor_gives_the_same_patches(tmp_path: Path) -> None:
    """The 8-bit shrink to the processor's own target (data/images.py) changes no patch value."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from shardfit.data.images import decoded, fit_of

    ip = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)
    rng = np.random.default_rng(0)
    for size in ((1531, 977), (640, 2000), (300, 300)):
        path = tmp_path / f"{size[0]}x{size[1]}.png"
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
        with Image.open(path) as im:
            whole = ip(images=[im.convert("RGB")], return_tensors="pt")
        small = decoded(str(path), fit_of(ip))
        assert small.size[0] * small.size[1] <= 112 * 112
        shrunk = ip(images=[small], return_tensors="pt")
        assert whole["image_grid_thw"].tolist() == shrunk["image_grid_thw"].tolist()
        assert (whole["pixel_values"] - shrunk["pixel_values"]).abs().max().item() == 0.0


def test_audio_cut_before_resampling_gives_the_same_samples() -> None:
    from types import SimpleNamespace

    from shardfit.data.audio import AudioProcessor, read_wav, resample

    fe = SimpleNamespace(sampling_rate=16000, n_samples=480000, hop_length=160)
    ap = AudioProcessor(fe, "<a>", 1, "<s>", "</s>", max_seconds=1.7)
    for rate in (1000, 8000, 22050, 44100, 48000, 96000):
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(2)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(np.random.default_rng(rate).integers(-3000, 3000, 2 * int(rate * 3.3),
                                                                dtype=np.int16).tobytes())
        x, r = read_wav(buf.getvalue())
        want = resample(x, r, 16000)[: ap.max_samples]
        assert np.array_equal(ap.samples(buf.getvalue()), want), rate
        assert len(want) == ap.n_samples(buf.getvalue())


PEAK = """
import resource, sys
from types import SimpleNamespace
kind, path = sys.argv[1], sys.argv[2]
if kind == "image":
    from shardfit.data.images import Fit, decoded
    run = lambda: decoded(path, Fit(28 * 28, 112 * 112, 14, 2, 3))  # Qwen2-VL's resize, bicubic: what it keeps
else:
    from shardfit.data.audio import AudioProcessor
    fe = SimpleNamespace(sampling_rate=16000, n_samples=480000, hop_length=160)
    run = lambda: AudioProcessor(fe, "<a>", 1, "<s>", "</s>", max_seconds=30.0).samples(path)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize(("kind", "limit_mib"), [("image", 120), ("audio", 150)])
def test_a_large_medium_costs_bounded_memory(tmp_path: Path, kind: str, limit_mib: int) -> None:
    """Peak memory over the imports of reading one medium: a 4096x4096 PNG for a model that sees at most 112x112
    pixels, decoded and shrunk before any float copy (measured: 64 MiB; 287 MiB through the image processor at
    full size, as before), a 5-minute 48 kHz WAV cut at 30 s (about 40 MiB; over 300 MiB resampled whole)."""
    path = png(tmp_path / "m.png", 4096, 4096) if kind == "image" else wav(tmp_path / "m.wav", 48000, 48000 * 300)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", PEAK, kind, str(path)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) < limit_mib, r.stdout


# ---- 6. the UI: malformed requests and form values out of range ---------------------------------------------------

@pytest.fixture()
def ui(tmp_path: Path) -> Iterator[tuple[int, str]]:
    from shardfit.ui.server import make_server

    server = make_server(tmp_path, port=0, read_timeout_s=1.0, body_deadline_s=2.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], server.guard.token
    finally:
        server.shutdown()
        server.server_close()


def _ask(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(request)
        out = b""
        try:
            while chunk := c.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


UI_CASES = [  # name, request (with {port} and {token}), status
    ("a one-word request line", b"GARBAGE\r\n\r\n", 400),
    ("an HTTP version from the future", b"GET / HTTP/9.9\r\n\r\n", 505),
    ("a version that is not a number", b"GET / HTTP/x.y\r\n\r\n", 400),
    ("a request line of 70 KB", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    ("a header line of 70 KB", b"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),
    ("150 headers", b"GET / HTTP/1.1\r\n" + b"".join(b"X%d: 1\r\n" % i for i in range(150)) + b"\r\n", 431),
    ("an unknown method", b"FOO / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 501),
    ("an unclosed IPv6 target", b"GET http://[::1/?token={token} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 400),
    ("a NUL in a run name", b"GET /runs/%00x?token={token} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 400),
    ("a raw non-ASCII token", b"GET /?token=\xc3\xa9 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", 403),
    *[(f"plan {field}={value}", f"GET /plan?token={{token}}&model=meta-llama/Llama-3.1-8B&{field}={value} HTTP/1.1"
       "\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(), 400)
      for field, value in (("seq", "-5"), ("seq", "0"), ("seq", "99999999999999999999"), ("seq", "1e3"),
                           ("batch", "0"), ("batch", "100000"), ("nodes", "0"), ("nodes", "-1"),
                           ("method", "bogus"), ("grad_ckpt", "bogus"))],
    ("launch nproc=10^9", b"POST /launch HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Shardfit-Token: {token}\r\n"
                          b"Content-Length: 31\r\n\r\nconfig=x.yaml&nproc=1000000000&", 400),
]


@pytest.mark.parametrize(("name", "request_bytes", "status"), UI_CASES, ids=[c[0] for c in UI_CASES])
def test_ui_answers_malformed_requests_with_a_status(ui: tuple[int, str], capfd: pytest.CaptureFixture, name: str,
                                                     request_bytes: bytes, status: int) -> None:
    port, token = ui
    answer = _ask(port, request_bytes.replace(b"{port}", str(port).encode()).replace(b"{token}", token.encode()))
    first = answer.split(b"\r\n", 1)[0]
    assert first.startswith(b"HTTP/1.") and int(first.split()[1]) == status, answer[:300]
    err = capfd.readouterr().err
    assert "failed" not in err and "Traceback" not in err, err


# ---- 7. a disk that fills during a checkpoint ---------------------------------------------------------------------

@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 400 KiB tmpfs: a real file system that fills up (needs root, as CI runs)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or 'not root'}): the disk-full path needs "
                    "a real file system that fills")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _state(n: int) -> tuple:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(n, n)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, n)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_a_full_disk_during_a_checkpoint_is_a_message_and_keeps_the_last_one(small_disk: Path) -> None:
    import torch

    from shardfit.errors import JobFailed
    from shardfit.parallel.env import DistEnv
    from shardfit.train.checkpoint import intact, list_checkpoints, save_checkpoint

    env = DistEnv(0, 1, 0, torch.device("cpu"), None)
    run = small_disk / "run"
    save_checkpoint(run, 1, 10, *_state(4), env, keep=2)  # a few KB: fits
    with pytest.raises(JobFailed) as failed:
        save_checkpoint(run, 2, 20, *_state(256), env, keep=2)  # 789 KB of weights and AdamW state: does not
    message = str(failed.value)
    assert message.startswith(f"disk full at {run / 'checkpoints'}: about 789,") and "bytes needed" in message
    assert "step-1) is intact" in message and "free disk space" in message
    assert [s for s, _ in list_checkpoints(run)] == [1] and intact(run / "checkpoints" / "step-1") is None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]  # the partial save is gone


def test_train_into_a_full_disk_exits_1_with_the_message(small_disk: Path, tiny_llama: Path, small_data: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(small_disk.parent / "full.yaml", model=str(tiny_llama), data=str(small_data),
                       method="full", precision="fp32", max_seq_len=512, micro_batch=1, max_steps=2, save_steps=1,
                       output_dir=str(small_disk / "run"))
    code, text = _run(["train", str(cfg)], capsys)
    assert "Traceback" not in text and "unexpected" not in text, text[-3000:]
    assert code == 1 and "disk full at" in text, text[-3000:]
