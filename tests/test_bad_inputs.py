"""Never a traceback: bad input of every kind ends with exit 2 (or the documented code), a message that names the
file, line or key and the fix, and no traceback. Cases run in-process through `shardfit.cli.main.main`, which is
what the `shardfit` command runs; most stop before anything heavy loads."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from shardfit.cli.main import main
from shardfit.config.schema import CHOICES, Config, LoraSettings, QLoraSettings
from tests.helpers import write_config

Case = tuple[str, Callable[[Path], list[str]], int, str]


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own exit after a usage error
        code = e.code
    out = capsys.readouterr()
    return code, out.err + out.out


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, small_data: Path) -> Path:
    """A workspace: a tiny model, good data, and room for bad files."""
    root = tmp_path_factory.mktemp("bad-inputs")
    shutil.copytree(tiny_llama, root / "model")
    shutil.copy(small_data, root / "data.jsonl")
    return root


def _cfg(ws: Path, name: str = "c.yaml", **keys: object) -> Path:
    base = dict(model=str(ws / "model"), data=str(ws / "data.jsonl"), precision="fp32", max_seq_len=128,
                micro_batch=2, max_steps=1, output_dir=str(ws / "runs" / name))
    base.update(keys)
    return write_config(ws / name, **{k: v for k, v in base.items() if v is not ...})


def _raw(ws: Path, name: str, text: str | bytes) -> Path:
    p = ws / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


# ---- 1. every config key against its declared range and type, from the schema itself ---------------------------

def _schema_cases() -> list[Case]:
    cases: list[Case] = []
    for cls, prefix in ((Config, ""), (LoraSettings, "lora."), (QLoraSettings, "qlora.")):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name, meta, hint = prefix + f.name, f.metadata, hints[f.name]
            bad: list[object] = []
            if meta.get("ge") is not None:
                bad.append(meta["ge"] - 1)
            if meta.get("gt") is not None:
                bad.append(meta["gt"])
            if meta.get("lt") is not None:
                bad.append(meta["lt"])
            if float in typing.get_args(hint) or hint is float:
                bad += [float("nan"), float("inf")]
            if meta.get("nonempty"):
                bad.append("")
            if name in CHOICES:
                bad.append("bogus-choice")
            if hint is int:
                bad += ["twelve", 1.5]
            if hint is bool:
                bad.append("maybe")
            if hint is str and name not in CHOICES and not meta.get("nonempty"):
                bad.append(["a", "list"])
            for value in bad:
                cases.append((f"config {name}={value!r}", _key_case(name, value), 2, name))
    return cases


def _key_case(name: str, value: object) -> Callable[[Path], list[str]]:
    def build(ws: Path) -> list[str]:
        keys: dict[str, object] = {}
        if "." in name:
            section, key = name.split(".")
            keys[section] = {key: value}
        else:
            keys[name] = value
        return ["plan", str(_cfg(ws, "schema.yaml", **keys)), "--gpus", "1x24GB"]
    return build


# ---- 2. the config file itself -----------------------------------------------------------------------------------

def _bomb(ws: Path) -> list[str]:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 28)]
    return ["plan", str(_raw(ws, "bomb.yaml", "\n".join(lines) + "\n")), "--gpus", "1x24GB"]


FILE_CASES: list[Case] = [
    ("config missing", lambda ws: ["train", str(ws / "nope.yaml")], 2, "config file not found"),
    ("config is a directory", lambda ws: ["train", str(ws / "model")], 2, "config file not found"),
    ("config latin-1", lambda ws: ["train", str(_raw(ws, "l1.yaml", "model: caf\xe9\n".encode("latin-1")))], 2,
     "not UTF-8"),
    ("config gzip", lambda ws: ["train", str(_raw(ws, "gz.yaml", b"\x1f\x8b\x08\x00garbage"))], 2, "not UTF-8"),
    ("config yaml syntax", lambda ws: ["train", str(_raw(ws, "syn.yaml", "model: [unclosed\n"))], 2,
     "not valid YAML"),
    ("config a list", lambda ws: ["train", str(_raw(ws, "list.yaml", "- model: x\n"))], 2, "must be a mapping"),
    ("config a scalar", lambda ws: ["train", str(_raw(ws, "scalar.yaml", "just text\n"))], 2, "must be a mapping"),
    ("config recursive anchor", lambda ws: ["train", str(_raw(ws, "rec.yaml", "data: &d [*d]\n"))], 2,
     "refers to itself"),
    ("config alias bomb", _bomb, 2, "expands to more than"),
    ("config duplicate key", lambda ws: ["train", str(_raw(ws, "dup.yaml", "lr: 1.0e-4\nepochs: 1\nlr: 2\n"))], 2,
     "given twice"),
    ("config seed beyond torch's 64 bits", lambda ws: ["train", str(_cfg(ws, seed=2**70))], 2,
     "'seed' must be below 9223372036854775808"),
    ("config unknown key", lambda ws: ["train", str(_cfg(ws, micro_batchs=2))], 2, "did you mean 'micro_batch'"),
    ("config lora not a mapping", lambda ws: ["train", str(_cfg(ws, lora=8))], 2, "'lora' must be a mapping"),
    ("config unknown lora key", lambda ws: ["train", str(_cfg(ws, lora={"rnak": 8}))], 2, "did you mean 'rank'"),
    ("config freeze without trainables", lambda ws: ["train", str(_cfg(ws, method="freeze"))], 2,
     "freeze_trainable"),
    ("config data missing", lambda ws: ["train", str(_cfg(ws, data=str(ws / "none.jsonl")))], 2,
     "file not found"),
    ("config eval_data missing", lambda ws: ["train", str(_cfg(ws, eval_data=str(ws / "none.jsonl")))], 2,
     "file not found"),
    ("config data list with a missing file", lambda ws: ["train", str(_cfg(ws, data=[str(ws / "data.jsonl"),
                                                                                      "gone.jsonl"]))], 2,
     "file not found"),
    ("config model missing path", lambda ws: ["train", str(_cfg(ws, model=str(ws / "no-model")))], 2,
     "does not exist"),
    ("config qlora without double quantization", lambda ws: ["train", str(_cfg(ws, method="qlora",
                                                                              qlora={"double_quant": False}))], 2,
     "'qlora.double_quant' is false"),
    ("config qlora not a mapping", lambda ws: ["train", str(_cfg(ws, method="qlora", qlora="nf4"))], 2,
     "'qlora' must be a mapping"),
]

# ---- 3. --set overrides ------------------------------------------------------------------------------------------

def _set_case(item: str) -> Callable[[Path], list[str]]:
    return lambda ws: ["train", str(_cfg(ws)), "--set", item]


SET_CASES: list[Case] = [
    (f"--set {item}", _set_case(item), 2, want)
    for item, want in [("lr", "expected key=value"), ("lrr=1", "did you mean 'lr'"), ("lr=abc", "'lr' must be"),
                       ("micro_batch=0", "'micro_batch' must be at least 1"), ("epochs=-1", "'epochs'"),
                       ("lr=.nan", "finite"), ("lora=5", "'lora' must be a mapping"),
                       ("lora.rank=0", "'lora.rank'"), ("lora.dropout=1.5", "'lora.dropout' must be below 1"),
                       ("lora.alpha=-16", "'lora.alpha'"), ("max_grad_norm=-1", "'max_grad_norm'"),
                       ("save_limit=0", "'save_limit'"), ("save_limit=-1", "'save_limit'"),
                       ("weight_decay=-5", "'weight_decay'"), ("output_dir=", "'output_dir'"),
                       ("strategy=fsdp", "choose one of"), ("precision=bf32", "did you mean")]
]

# ---- 4. command-line arguments -----------------------------------------------------------------------------------

CLI_CASES: list[Case] = [
    ("no command", lambda ws: [], 2, "required"),
    ("unknown command", lambda ws: ["fly"], 2, "invalid choice"),
    ("train --nproc 0", lambda ws: ["train", "--nproc", "0"], 2, "at least 1"),
    ("train --nproc -2", lambda ws: ["train", "--nproc", "-2"], 2, "at least 1"),
    ("train --nproc two", lambda ws: ["train", "--nproc", "two"], 2, "integer"),
    ("train --nnodes 0", lambda ws: ["train", "--nnodes", "0"], 2, "at least 1"),
    ("train --node-rank 5 --nnodes 2", lambda ws: ["train", str(_cfg(ws)), "--nnodes", "2", "--node-rank", "5"], 2,
     "--node-rank 5"),
    ("train --node-rank -1", lambda ws: ["train", "--node-rank", "-1"], 2, "0 or more"),
    ("train --master-port 99999", lambda ws: ["train", "--master-port", "99999"], 2, "1-65535"),
    ("train --master-port 0", lambda ws: ["train", "--master-port", "0"], 2, "1-65535"),
    ("train --max-restarts -1", lambda ws: ["train", "--max-restarts", "-1"], 2, "0 or more"),
    ("train model_parallel on 2 ranks", lambda ws: ["train", str(_cfg(ws, strategy="model_parallel")), "--nproc",
                                                    "2"], 2, "cannot run on 2 ranks"),
    ("train strict device_map on 2 ranks", lambda ws: ["train", str(_cfg(ws, device_map="auto", strict=True)),
                                                       "--nproc", "2"], 2, "device_map"),
    ("plan nothing to plan", lambda ws: ["plan"], 2, "CONFIG.yaml or --model"),
    ("plan unknown model", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8b-typo"], 2, "Did you mean"),
    ("plan unknown card", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "2xRTX9999"], 2,
     "unknown card"),
    ("plan zero GPUs", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "0x24GB"], 2,
     "at least one GPU"),
    ("plan --gpus a count with extra digits", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus",
                                                          "1000000x24GB"], 2, "more than any cluster"),
    ("plan --nodes with extra digits", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--nodes",
                                                   "125001", "--gpus", "8xH100"], 2, "more than any cluster"),
    ("plan --gpus two kinds of card", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus",
                                                  "2xH100+2xA100"], 2, "one kind of GPU per plan"),
    ("plan --gpus a list of cards", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus",
                                                "1xH100,1xA100"], 2, "one kind of GPU per plan"),
    ("plan qlora with expert_parallel", lambda ws: ["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "8xH100",
                                                    "--expert-parallel", "8", "--method", "qlora"], 2,
     "expert_parallel: 8 does not train qlora"),
    ("plan freeze with expert_parallel", lambda ws: ["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "8xH100",
                                                     "--expert-parallel", "8", "--method", "freeze"], 2,
     "expert_parallel: 8 trains method lora or full"),
    ("plan --seq 0", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--seq", "0"], 2, "at least 1"),
    ("plan --batch 0", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--batch", "0"], 2, "at least 1"),
    ("plan --nodes 0", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--nodes", "0"], 2, "at least 1"),
    ("plan --lora-rank -8", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--lora-rank", "-8"], 2,
     "at least 1"),
    ("plan --grad-accum 0", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--grad-accum", "0"], 2,
     "at least 1"),
    ("plan --cpu-mem -1", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--cpu-mem", "-1"], 2,
     "greater than 0"),
    ("plan --cpu-mem nan", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--cpu-mem", "nan"], 2,
     "finite"),
    ("plan --method bogus", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--method", "bogus"], 2,
     "invalid choice"),
    ("plan --strategy bogus", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--strategy", "bogus"], 2,
     "choose one of"),
    ("plan --plot into a missing folder", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus",
                                                      "1x24GB", "--plot", str(ws / "no" / "dir" / "p.png")], 2,
     "does not exist"),
    ("plan --plot odd extension", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x24GB",
                                              "--plot", str(ws / "p.xyz")], 2, "cannot write"),
    ("plan missing config", lambda ws: ["plan", str(ws / "nope.yaml")], 2, "config file not found"),
    ("plan --seq 8.5k", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x24GB", "--seq", "8.5k"],
     2, "a length like 8k"),
    ("plan --seq 0k", lambda ws: ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x24GB", "--seq", "0k"], 2,
     "--seq: must be at least 1"),
    ("check --nproc 0", lambda ws: ["check", str(_cfg(ws)), "--nproc", "0"], 2, "at least 1"),
    ("check --nodes 0", lambda ws: ["check", str(_cfg(ws)), "--nodes", "0"], 2, "at least 1"),
    ("check missing config", lambda ws: ["check", str(ws / "nope.yaml")], 2, "config file not found"),
    ("check --gpus garbage", lambda ws: ["check", str(_cfg(ws)), "--gpus", "lots"], 2, "unknown card"),
    ("diagnose missing file", lambda ws: ["diagnose", str(ws / "nope.log")], 2, "no such file"),
    ("diagnose a directory", lambda ws: ["diagnose", str(ws)], 2, "is a folder"),
    ("chat --output a folder", lambda ws: ["chat", str(ws / "model"), "--input", str(ws / "data.jsonl"), "--output",
                                           str(ws)], 2, "--output"),
    ("chat --temperature nan", lambda ws: ["chat", str(ws / "model"), "--prompt", "hi", "--temperature", "nan"], 2,
     "--temperature"),
    ("chat --top-p 2", lambda ws: ["chat", str(ws / "model"), "--prompt", "hi", "--temperature", "1", "--top-p", "2"],
     2, "--top-p"),
    ("eval --max-seq-len 0", lambda ws: ["eval", str(ws / "model"), "--data", str(ws / "data.jsonl"), "--max-seq-len",
                                         "0"], 2, "--max-seq-len: must be at least 1"),
    ("convert --out a folder", lambda ws: ["convert", "--from", "llamafactory", str(_raw(
        ws, "lf.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nstage: sft\n")), "--out", str(ws)], 2, "--out"),
    ("doctor --timeout nan", lambda ws: ["doctor", "--timeout", "nan"], 2, "--timeout must be positive"),
    ("export missing run", lambda ws: ["export", str(ws / "no-run")], 2, "not a shardfit run directory"),
    ("export a file", lambda ws: ["export", str(ws / "data.jsonl")], 2, "not a shardfit run directory"),
]


def _run_dir(ws: Path, name: str, config_text: str, adapter: dict | None = None) -> Path:
    run = ws / name
    run.mkdir(exist_ok=True)
    (run / "config.yaml").write_text(config_text)
    if adapter is not None:
        (run / "adapter").mkdir(exist_ok=True)
        (run / "adapter" / "adapter_config.json").write_text(json.dumps(adapter))
    return run


EXPORT_CASES: list[Case] = [
    ("export empty config", lambda ws: ["export", str(_run_dir(ws, "e1", "", {})), "--merge"], 2,
     "does not name the run's model"),
    ("export config without model", lambda ws: ["export", str(_run_dir(ws, "e2", "lr: 1\n", {})), "--merge"], 2,
     "does not name the run's model"),
    ("export adapter_config {}", lambda ws: ["export", str(_run_dir(ws, "e3", yaml.safe_dump(
        {"model": str(ws / "model"), "precision": "fp32"}), {})), "--merge", "--out", str(ws / "m3")], 2,
     "not an adapter"),
    ("export no adapter to merge", lambda ws: ["export", str(_run_dir(ws, "e4", yaml.safe_dump(
        {"model": str(ws / "model")}))), "--merge"], 2, "no adapter/ to merge"),
    ("export no adapter to copy", lambda ws: ["export", str(_run_dir(ws, "e5", yaml.safe_dump(
        {"model": str(ws / "model")})))], 2, "has no adapter/"),
    ("export --dtype bogus", lambda ws: ["export", str(ws), "--dtype", "fp8"], 2, "invalid choice"),
]

# ---- 5. data files (check runs the same data validation train runs, before any model loads) ----------------------


def _data_case(name: str, content: str | bytes, want: str, suffix: str = ".jsonl", **keys: object) -> Case:
    def build(ws: Path) -> list[str]:
        data = _raw(ws, f"{name}{suffix}", content)
        return ["check", str(_cfg(ws, f"{name}.yaml", data=str(data), **keys)), "--json"]
    return (f"data {name}", build, 2, want)


ROW = {"instruction": "Say hi", "output": "hi"}
OPENAI = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
DATA_CASES: list[Case] = [
    _data_case("empty", "", "no usable rows"),
    _data_case("blank-lines", "\n\n\n", "no usable rows"),
    _data_case("not-json", "this is not json\n", ":1: not valid JSON"),
    _data_case("broken-second-line", json.dumps(ROW) + "\n{broken\n", ":2: not valid JSON"),
    _data_case("unknown-format", json.dumps({"question": "a", "answer": "b"}) + "\n", "unknown format"),
    _data_case("alpaca-no-output", json.dumps(ROW) + "\n" + json.dumps({"instruction": "x"}) + "\n",
               "without 'output'"),
    _data_case("alpaca-output-int", json.dumps({"instruction": "x", "output": 5}) + "\n", "must be a string"),
    _data_case("alpaca-instruction-null", json.dumps({"instruction": None, "output": "y"}) + "\n", "must be a string"),
    _data_case("alpaca-history-broken", json.dumps({**ROW, "history": ["a"]}) + "\n", "'history' must be"),
    _data_case("alpaca-system-int", json.dumps({**ROW, "system": 3}) + "\n", "must be a string"),
    _data_case("sharegpt-bot", json.dumps({"conversations": [{"from": "human", "value": "a"},
                                                            {"from": "bot", "value": "b"}]}) + "\n",
               "unknown speaker 'bot'"),
    _data_case("sharegpt-no-value", json.dumps({"conversations": [{"from": "human"}]}) + "\n", "needs 'from' and"),
    _data_case("sharegpt-turn-string", json.dumps({"conversations": ["hi"]}) + "\n", "needs 'from' and"),
    _data_case("sharegpt-no-assistant", json.dumps({"conversations": [{"from": "human", "value": "a"}]}) + "\n",
               "no assistant turn"),
    _data_case("openai-bad-role", json.dumps({"messages": [{"role": "robot", "content": "a"}]}) + "\n",
               "unknown role 'robot'"),
    _data_case("openai-content-list", json.dumps({"messages": [{"role": "user", "content": "a"},
                                                               {"role": "assistant", "content": [1]}]}) + "\n",
               "a content part needs type text, image, image_url, audio, input_audio or video"),
    _data_case("openai-no-content", json.dumps({"messages": [{"role": "user"}]}) + "\n", "needs 'role' and"),
    _data_case("openai-messages-dict", json.dumps(OPENAI) + "\n" + json.dumps({"messages": {"a": 1}}) + "\n",
               "without a 'messages' list"),
    _data_case("row-is-list", json.dumps([1, 2]) + "\n", "unknown format"),
    _data_case("mixed-format-row", json.dumps(SHAREGPT) + "\n" + json.dumps(ROW) + "\n",
               "without a 'conversations' list"),
    _data_case("lone-surrogate", '{"instruction": "a\\ud800b", "output": "x"}\n', "unpaired surrogate"),
    _data_case("latin1", ('{"instruction": "caf\xe9", "output": "x"}\n').encode("latin-1"), "not UTF-8"),
    _data_case("gzip", b"\x1f\x8b\x08\x00\x00\x00\x00", "gzip-compressed"),
    _data_case("parquet", b"PAR1\x00\x00\x00", "Parquet"),
    _data_case("zip", b"PK\x03\x04\x00\x00", "zip archive"),
    _data_case("json-not-array", json.dumps("just a string"), "expected a JSON array", suffix=".json"),
    _data_case("json-broken", "[{\"instruction\": ", "not valid JSON", suffix=".json"),
    _data_case("json-item-bad", json.dumps([ROW, {"instruction": 1, "output": "x"}]), "item 1", suffix=".json"),
    _data_case("all-too-long", json.dumps({"instruction": "word " * 200, "output": "x"}) + "\n",
               "no example keeps an assistant token", max_seq_len=16),
    _data_case("many-too-long", "".join(json.dumps({"instruction": "word " * (200 if i % 2 else 1), "output": "x"})
                                        + "\n" for i in range(10)), "more than max_bad_rows", max_seq_len=64),
]

# ---- 6. model files ----------------------------------------------------------------------------------------------


def _model_copy(ws: Path, name: str, edit: Callable[[Path], None]) -> Path:
    out = ws / name
    if not out.exists():
        shutil.copytree(ws / "model", out)
        edit(out)
    return out


def _config_edit(**changes: object) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


def _write(name: str, content: bytes | str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        p = folder / name
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
    return edit


def _truncate_weights(folder: Path) -> None:
    p = folder / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])


def _drop_tokenizer(folder: Path) -> None:
    for f in folder.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt", "chat_template.jinja"):
            f.unlink()


def _model_case(name: str, edit: Callable[[Path], None], want: str, command: str = "train",
                **keys: object) -> Case:
    def build(ws: Path) -> list[str]:
        model = _model_copy(ws, f"model-{name}", edit)
        return [command, str(_cfg(ws, f"m-{name}.yaml", model=str(model), **keys))]
    return (f"model {name} ({command})", build, 2, want)


MODEL_CASES: list[Case] = [
    _model_case("config-garbage", _write("config.json", "{not json"), "not a valid config.json", "plan"),
    _model_case("config-list", _write("config.json", "[1, 2]"), "one JSON object", "plan"),
    _model_case("zero-heads", _config_edit(num_attention_heads=0), "num_attention_heads", "plan"),
    _model_case("negative-layers", _config_edit(num_hidden_layers=-2), "num_hidden_layers", "plan"),
    _model_case("negative-head-dim", _config_edit(head_dim=-1), "config.json's head_dim is -1", "plan"),
    _model_case("negative-kv-heads", _config_edit(num_key_value_heads=-2), "num_key_value_heads is -2", "plan"),
    _model_case("heads-string", _config_edit(num_attention_heads="four"), "num_attention_heads", "plan"),
    _model_case("config-garbage", _write("config.json", "{not json"), "'model'", "check"),
    _model_case("zero-heads", _config_edit(num_attention_heads=0), "'model'", "check"),
    _model_case("truncated-weights", _truncate_weights, "cannot load"),
    _model_case("random-weights", _write("model.safetensors", os.urandom(4096)), "cannot load"),
    _model_case("weights-header-lies", _write("model.safetensors", struct.pack("<Q", 10**12) + b"{}"),
                "cannot load"),
    _model_case("no-tokenizer", _drop_tokenizer, "tokenizer"),
    _model_case("remote-code", _config_edit(model_type="mystery", auto_map={"AutoConfig": "cfg.MysteryConfig"}),
                "trust_remote_code", "check"),
    ("model a garbage file", lambda ws: ["train", str(_cfg(ws, "mg.yaml", model=str(_raw(ws, "weights.bin",
                                                                                          b"junk"))))], 2,
     "is a file, not a model"),
    ("model a garbage .gguf", lambda ws: ["train", str(_cfg(ws, "mgg.yaml", model=str(_raw(ws, "junk.gguf",
                                                                                            b"GGUF junk"))))], 2,
     "cannot"),
    ("model folder with two gguf", lambda ws: ["train", str(_cfg(ws, "m2g.yaml", model=str(_two_gguf(ws))))], 2,
     "2 .gguf files"),
    ("model unknown hub id offline", lambda ws: ["check", str(_cfg(ws, "hub.yaml", model="nobody/not-a-model"))], 2,
     "catalog"),
    ("lora targets not in the model", lambda ws: ["train", str(_cfg(ws, "lt.yaml", lora={"targets": ["nope"]}))],
     2, "lora.targets"),
    ("lora targets a broken regex", lambda ws: ["train", str(_cfg(ws, "lr.yaml", lora={"targets": "[q_proj"}))],
     2, "lora.targets"),
    ("freeze pattern matches nothing", lambda ws: ["train", str(_cfg(ws, "fz.yaml", method="freeze",
                                                                     freeze_trainable=["nothing.here"]))], 2,
     "freeze_trainable"),
    ("drop the decoder", lambda ws: ["train", str(_cfg(ws, "dd.yaml", drop_modules=["model.layers"]))], 2,
     "'drop_modules'"),
    ("attention kernel not installed", lambda ws: ["train", str(_cfg(ws, "fa.yaml",
                                                                     attn_implementation="flash_attention_2"))], 2,
     "attn_implementation"),
]


def _two_gguf(ws: Path) -> Path:
    folder = ws / "two-gguf"
    folder.mkdir(exist_ok=True)
    for name in ("a.gguf", "b.gguf"):
        (folder / name).write_bytes(b"GGUF")
    return folder

# ---- 7. the run directory ----------------------------------------------------------------------------------------


def _busy(ws: Path) -> list[str]:
    run = ws / "runs" / "busy"
    run.mkdir(parents=True, exist_ok=True)
    (run / ".shardfit.lock").write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                    "started": "now"}))
    return ["train", str(_cfg(ws, "busy.yaml", output_dir=str(run)))]


def _foreign(ws: Path) -> list[str]:
    run = ws / "runs" / "foreign"
    (run / "checkpoints" / "step-3").mkdir(parents=True, exist_ok=True)
    (run / "checkpoints" / "step-3" / "trainer.pt").write_bytes(b"x")
    return ["train", str(_cfg(ws, "foreign.yaml", output_dir=str(run)))]


def _other_run(ws: Path) -> list[str]:
    run = ws / "runs" / "other"
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(json.dumps({"fingerprint": {"model": "someone-else", "lr": 1.0}}))
    return ["train", str(_cfg(ws, "other.yaml", output_dir=str(run)))]


def _damaged_run(name: str, run_json: str) -> Callable[[Path], list[str]]:
    def build(ws: Path) -> list[str]:
        run = ws / "runs" / name
        (run / "checkpoints" / "step-1").mkdir(parents=True, exist_ok=True)
        (run / "run.json").write_text(run_json)
        return ["train", str(_cfg(ws, f"{name}.yaml", output_dir=str(run)))]
    return build


def _lock_without_pid(ws: Path) -> list[str]:
    run = ws / "runs" / "lock-null-pid"
    run.mkdir(parents=True, exist_ok=True)
    (run / ".shardfit.lock").write_text(json.dumps({"pid": None, "host": os.uname().nodename}))
    return ["train", str(_cfg(ws, "lock-null-pid.yaml", output_dir=str(run)))]


RUN_DIR_CASES: list[Case] = [
    ("run.json a list", _damaged_run("rj-list", "[1]"), 2, "is not a file shardfit wrote"),
    ("run.json fingerprint a string", _damaged_run("rj-str", json.dumps({"fingerprint": "x"})), 2,
     "is not a file shardfit wrote"),
    ("run.json truncated", _damaged_run("rj-cut", '{"fingerprint": {"mod'), 2, "not the run record shardfit writes"),
    ("lock file with a null pid", _lock_without_pid, 2, "in use by another training"),
    ("output_dir is a file", lambda ws: ["train", str(_cfg(ws, "of.yaml", output_dir=str(ws / "data.jsonl")))], 2,
     "is a file"),
    ("output_dir not writable", lambda ws: ["train", str(_cfg(ws, "ow.yaml", output_dir="/proc/shardfit-run"))], 2,
     "not writable"),
    ("output_dir in use", _busy, 2, "in use by another training"),
    ("output_dir with another tool's checkpoints", _foreign, 2, "without a run.json"),
    ("output_dir with a different run", _other_run, 2, "holds a different run"),
    ("resume path not a checkpoint", lambda ws: ["train", str(_cfg(ws, "rp.yaml", resume=str(ws)))], 2,
     "not a shardfit checkpoint"),
]

def _hf_script(name: str, script: bytes) -> Callable[[Path], list[str]]:
    """`plan --from hf` of a command running the training script `script` (bytes as written)."""
    def build(ws: Path) -> list[str]:
        job = ws / "hf-scripts" / name
        job.mkdir(parents=True, exist_ok=True)
        (job / "train.py").write_bytes(script)
        (job / "run.sh").write_text("python train.py --model_name_or_path Qwen/Qwen2.5-0.5B\n")
        return ["plan", "--from", "hf", str(job / "run.sh"), "--gpus", "1x80GB"]
    return build


FOREIGN_CASES: list[Case] = [
    ("hf training script in Latin-1", _hf_script("latin1", b"import x\n\xff\xfe bad\n"), 2, "not UTF-8 text"),
    ("hf training script nested too deeply", _hf_script("deep", b"x=" + b"-" * 100000 + b"1\n"), 2,
     "nested too deeply"),
]

CASES: list[Case] = (_schema_cases() + FILE_CASES + SET_CASES + CLI_CASES + EXPORT_CASES + DATA_CASES + MODEL_CASES
                     + RUN_DIR_CASES + FOREIGN_CASES)


def test_there_are_at_least_150_cases() -> None:
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize(("name", "build", "code", "want"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_message_not_a_traceback(ws: Path, capsys: pytest.CaptureFixture, name: str,
                                                build: Callable[[Path], list[str]], code: int, want: str) -> None:
    got, text = _run(build(ws), capsys)
    assert "Traceback" not in text, text[-3000:]
    assert "unexpected" not in text, text[-3000:]  # the last guard's message: a case nothing handled
    assert got == code, text[-3000:]
    assert want in text, text[-3000:]
