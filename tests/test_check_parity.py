"""`check` refuses what `train` refuses: a config naming files a rank opens as it starts (a `resume:` checkpoint,
a `py:` scorer of eval_metrics) that are missing is exit 2 from both, with the same words naming the key. One
exception: a `resume:` path with nothing at it where check runs may be on the machine that trains, so check warns
(saying where it looked) where train refuses."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan.hardware import job_hardware, parse_gpus
from shardfit.resolve import DeviceFacts, resolve_job
from tests.helpers import write_config


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.err + out.out


def _config(tmp_path: Path, model: Path, data: Path, **keys: object) -> Path:
    return write_config(tmp_path / "c.yaml", model=str(model), data=str(data), precision="fp32", max_seq_len=64,
                        micro_batch=2, max_steps=1, output_dir=str(tmp_path / "run"), **keys)


@pytest.mark.parametrize(("keys", "want"), [
    ({"resume": "{tmp}"}, "'resume': {tmp} is not a shardfit checkpoint (no trainer.pt in it)"),
    ({"eval_metrics": ["py:/nonexistent/scorer.py:f"]}, "metric py:/nonexistent/scorer.py:f: no file"),
    # other tools' word for the newest checkpoint names nothing on any machine: no "run check where it trains"
    ({"resume": "latest"}, "'resume': 'latest' is no checkpoint path. Use resume: auto"),
    # a path the OS refuses to look at (here: a name too long) was an unexpected OSError, exit 1
    ({"resume": "{tmp}/" + "s" * 300}, "'resume': {tmp}/" + "s" * 300 + " cannot be read on "),
], ids=["resume-path", "py-scorer", "resume-latest", "resume-name-too-long"])
def test_check_refuses_what_train_refuses(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                          capsys: pytest.CaptureFixture, keys: dict, want: str) -> None:
    keys = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in keys.items()}
    want = want.format(tmp=tmp_path)
    cfg = str(_config(tmp_path, tiny_llama, small_data, **keys))
    check = _run(["check", cfg], capsys)
    train = _run(["train", cfg], capsys)
    assert check[0] == train[0] == 2, (check, train)
    assert want in check[1] and want in train[1], (check[1][-800:], train[1][-800:])
    assert "Traceback" not in check[1] + train[1]


def test_a_resume_path_absent_here_is_a_warning_of_check(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """A `resume:` path with nothing at it where check runs (a login node without the cluster's scratch, or a
    checkpoint a queued job will write) was exit 2, stopping every other rule. check now says it looked on this
    machine and how to check on the node (a warning: exit 0, the other rules run); train there still refuses it
    (exit 2), now saying where it looked."""
    import socket

    absent = "/nonexistent/checkpoints/step-5"
    cfg = str(_config(tmp_path, tiny_llama, small_data, resume=absent, max_bad_rows=64))
    code = main(["check", cfg, "--json"])
    said = capsys.readouterr()
    assert said.out.startswith("{"), said.err[-2000:]
    out = said.out
    found = {f["rule"]: f for f in json.loads(out)["findings"]}
    assert code == 0 and found["resume_not_here"]["severity"] == "warning", out
    assert f"'resume': {absent} does not exist on {socket.gethostname()}, the machine check ran on" \
        in found["resume_not_here"]["message"]
    assert "srun -N1 shardfit check CONFIG" in found["resume_not_here"]["fix"]
    code, out = _run(["train", cfg], capsys)
    assert code == 2 and f"'resume': {absent} is not a shardfit checkpoint (nothing is at that path on " \
        f"{socket.gethostname()})" in out and "Traceback" not in out, out


def test_the_refusal_names_a_real_checkpoint_never_the_refused_path(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal's example was fixed text (runs/demo/checkpoints/step-200), the very path refused when the user
    gave it; it now names the newest checkpoint of the run the path points into (or of output_dir), and where
    there is none, what a checkpoint's path is."""
    from shardfit.resolve.checkpoint_files import named_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        named_checkpoint("runs/demo/checkpoints/step-200", "runs/demo")
    said = str(e.value)
    assert said.count("runs/demo/checkpoints/step-200") == 1, said
    assert "a step-N folder under a run's checkpoints/, holding trainer.pt; runs/demo/checkpoints holds none" in said
    for step in (100, 150):
        (tmp_path / "runs" / "demo" / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "runs" / "demo" / "checkpoints" / f"step-{step}" / "trainer.pt").write_bytes(b"x")
    (tmp_path / "runs" / "demo" / "checkpoints" / ".tmp-step-175").mkdir()
    for refused, output_dir in (("runs/demo/checkpoints/step-200", None), ("runs/demo", None),
                                ("elsewhere/step-1", "runs/demo")):
        with pytest.raises(UserError, match=r"e\.g\. runs/demo/checkpoints/step-150 \(the newest whole one of 2 in "
                                            r"runs/demo/checkpoints\)"):
            named_checkpoint(refused, output_dir)


def test_a_resume_path_expands_home_as_data_and_model_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`resume: ~/runs/x/checkpoints/step-5` was taken literally (a folder named ~), so train refused it on every
    machine while check said to run where it trains."""
    from shardfit.resolve.checkpoint_files import absent_here, named_checkpoint

    ckpt = tmp_path / "runs" / "x" / "checkpoints" / "step-5"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.pt").write_bytes(b"x")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "runs")
    assert not absent_here("~/runs/x/checkpoints/step-5")
    assert named_checkpoint("~/runs/x/checkpoints/step-5") == ckpt


def test_a_resume_path_in_an_unknown_users_home_is_exit_2() -> None:
    """`~nosuchuser/...` raised Path.expanduser's RuntimeError (the last guard's exit 1) from check and train."""
    from shardfit.errors import UserError
    from shardfit.resolve.checkpoint_files import absent_here

    with pytest.raises(UserError, match="'resume'.*does not know"):
        absent_here("~shardfit-no-such-user/runs/x/checkpoints/step-5")


def test_an_output_dir_in_an_unknown_users_home_is_exit_2_naming_it(tmp_path: Path, tiny_llama: Path,
                                                                    small_data: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """A refused `resume:` looks for a checkpoint to suggest in output_dir, whose `~nosuchuser/...` raised
    expanduser's RuntimeError (exit 1 from check and train) instead of naming output_dir."""
    (tmp_path / "not-a-checkpoint").mkdir()
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), precision="fp32",
                       max_seq_len=64, micro_batch=2, max_steps=1, output_dir="~shardfit-no-such-user/run",
                       resume=str(tmp_path / "not-a-checkpoint"))
    for command in ("check", "train"):
        code, out = _run([command, str(cfg)], capsys)
        assert code == 2 and "'output_dir': '~shardfit-no-such-user/run' names the home of a user" in out, out[-800:]
        assert "Traceback" not in out


def test_the_refusals_example_is_a_checkpoint_train_would_take(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The "e.g." checkpoint was the newest with a trainer.pt, even a damaged one that train's auto mode skips."""
    from shardfit.resolve.checkpoint_files import named_checkpoint

    monkeypatch.chdir(tmp_path)
    for step in (100, 150):
        (tmp_path / "runs" / "demo" / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "runs" / "demo" / "checkpoints" / f"step-{step}" / "trainer.pt").write_bytes(b"x")
    (tmp_path / "runs" / "demo" / "checkpoints" / "step-150" / "manifest.json").write_text(
        '{"trainer.pt": {"bytes": 99, "sha256": "0"}}')
    with pytest.raises(UserError, match=r"e\.g\. runs/demo/checkpoints/step-100 \(the newest whole one of 1 in "):
        named_checkpoint("runs/demo/checkpoints/step-200")


def test_a_damaged_named_checkpoint_is_refused_by_check(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    ckpt = tmp_path / "old" / "checkpoints" / "step-3"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.pt").write_bytes(b"x")
    (ckpt / "manifest.json").write_text('{"trainer.pt": {"bytes": 99, "sha256": "0"}}')
    code, out = _run(["check", str(_config(tmp_path, tiny_llama, small_data, resume=str(ckpt)))], capsys)
    assert code == 2 and f"'resume': {ckpt} is damaged (trainer.pt has 1 bytes, not 99)" in out, out


def test_check_reads_a_scorer_without_running_it(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """`check` on a config someone handed over runs none of the code it names: a `py:` scorer is parsed, not
    imported (a file that writes a marker on import leaves none), and a function it lacks is refused by name."""
    marker = tmp_path / "ran"
    scorer = tmp_path / "scorer.py"
    scorer.write_text(f"open({str(marker)!r}, 'w').write('x')\n\ndef score(p, e, row):\n    return p == e\n")
    code, out = _run(["check", str(_config(tmp_path, tiny_llama, small_data,
                                           eval_metrics=[f"py:{scorer}:score"], max_bad_rows=64))], capsys)
    assert code in (0, 1) and not marker.exists(), out
    code, out = _run(["check", str(_config(tmp_path, tiny_llama, small_data,
                                           eval_metrics=[f"py:{scorer}:other"]))], capsys)
    assert code == 2 and f"{scorer} has no function other (it has: score)" in out and not marker.exists(), out


@pytest.fixture
def eight_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine faked as one node of eight 24 GB GPUs (as `train` and `check` read it)."""
    from shardfit.parallel import job as rank_job

    monkeypatch.setattr(rank_job, "node_hardware", lambda threads=None: parse_gpus("8x24GB", 1, None))
    monkeypatch.setattr(rank_job, "cuda_available", lambda: True)
    monkeypatch.setattr(rank_job, "device_facts", lambda device, precision="auto": DeviceFacts("cuda", True))


def _llama(**over: object) -> Config:
    return dataclasses.replace(Config(), model="meta-llama/Llama-3.1-8B", method="lora", max_seq_len=1024,
                               grad_ckpt="full", micro_batch=1, **over)


def test_more_ranks_a_node_than_its_gpus_is_refused_by_check_and_train(eight_gpus: None) -> None:
    """`check --nproc 16` without --gpus resolved 16 ranks on this 8-GPU node, a job train launches but whose
    ranks 8 to 15 have no GPU; both now refuse it (exit 2), and 8 ranks a node (or 16 over 2 nodes) resolve."""
    from shardfit.check.run import check_config
    from shardfit.cli.train_cmd import decide_launch
    from shardfit.parallel.job import resolve_here

    args = argparse.Namespace(nproc=16, nnodes=1, node_rank=0, master_addr=None, master_port=None,
                              rdzv_endpoint=None)
    for refused in (lambda: check_config(_llama(), 16), lambda: decide_launch(args, _llama()),
                    lambda: check_config(_llama(), 16, parse_gpus("8x24GB", 1, None))):
        with pytest.raises(UserError, match="--nproc 16: 16 ranks a node, more than the node's 8 GPUs") as e:
            refused()
        assert e.value.exit_code == 2
    job, _ = resolve_here(_llama(), nproc=8, nnodes=2)
    assert job.world == 16 and job.nproc_per_node == 8
    with pytest.raises(UserError, match="--nproc counts the ranks of one node"):  # 16 in all over 2 nodes: 8
        check_config(_llama(), 16, None, 2)
    # On a CPU torchrun's 16 ranks share the host and run (gloo): resolved as train runs them.
    cpu, _ = resolve_job(_llama(precision="fp32", strategy="ddp", force=True), job_hardware("cpu", 1),
                         DeviceFacts("cpu", False), nproc=16)
    assert (cpu.device, cpu.nproc_per_node, cpu.nnodes) == ("cpu", 16, 1)


@pytest.mark.parametrize("nodes", [1, 2])
def test_check_nproc_counts_ranks_a_node_as_train_does(eight_gpus: None, tmp_path: Path, tiny_llama: Path,
                                                       small_data: Path, capsys: pytest.CaptureFixture,
                                                       nodes: int) -> None:
    """`check --nproc N --nodes M` took N as the ranks of the whole run where `train --nproc N --nnodes M` (and
    torchrun's --nproc-per-node) takes N a node: on 2 nodes check resolved half the ranks train launches. Both now
    count ranks a node, and check takes train's --nnodes spelling too."""
    from shardfit.check.run import check_config
    from shardfit.cli.train_cmd import decide_launch
    from shardfit.config import load_config

    cfg = load_config(str(_config(tmp_path, tiny_llama, small_data, strategy="ddp", max_bad_rows=64)))
    args = argparse.Namespace(nproc=4, nnodes=nodes, node_rank=0, master_addr="10.0.0.1", master_port=None,
                              rdzv_endpoint=None)
    trained, _ = decide_launch(args, cfg)
    checked, _ = check_config(cfg, 4, None, nodes)
    planned, _ = check_config(cfg, 4, parse_gpus("8x24GB", nodes, None))
    assert trained is not None and (trained.nproc_per_node, trained.nnodes, trained.world) == (4, nodes, 4 * nodes)
    assert checked.decisions() == trained.decisions() and planned.world == 4 * nodes
    code = main(["check", str(tmp_path / "c.yaml"), "--nproc", "4", "--nnodes", str(nodes), "--json",
                 "--set", "strategy=ddp", "--set", "max_bad_rows=64"])
    resolved = json.loads(capsys.readouterr().out)["resolved"]
    assert code in (0, 1) and (resolved["nproc_per_node"], resolved["nnodes"]) == (4, nodes), resolved


def test_a_scorer_defined_under_a_condition_still_trains(tmp_path: Path) -> None:
    """The syntax-tree check refuses only what the file's text settles: a scorer defined under `if`, in `try`, by
    tuple assignment or behind a star import passes (the import decides at train), a missing name does not."""
    from shardfit.evals.scorers import check_metrics

    bodies = {"cond": "import sys\nif sys.version_info >= (3, 8):\n    def score(p, e, r):\n        return 1\n",
              "try": "try:\n    from math import score\nexcept ImportError:\n"
                     "    def score(p, e, r):\n        return 1\n",
              "tuple": "score, other = (lambda p, e, r: 1), 2\n", "star": "from os.path import *\n"}
    for name, body in bodies.items():
        (tmp_path / f"{name}.py").write_text(body)
        check_metrics([f"py:{tmp_path / name}.py:score"])
    (tmp_path / "none.py").write_text("def other(p, e, r):\n    return 1\n")
    with pytest.raises(UserError, match="has no function score \\(it has: other\\)"):
        check_metrics([f"py:{tmp_path / 'none.py'}:score"])
    (tmp_path / "bad.py").write_text("def score(:\n")
    with pytest.raises(UserError, match="is not valid Python"):
        check_metrics([f"py:{tmp_path / 'bad.py'}:score"])


def test_checks_strategy_verdict_is_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """check's verdict on a strategy without a pipeline is resolve/fits.py `memory_verdict`, the one the rank
    refuses by (`refuse_if_oom`), not a reading of the plan's candidate of its own: a verdict that says otherwise
    than the candidate is the one check reports."""
    from shardfit.check import rules
    from shardfit.errors import DoesNotFitError
    from shardfit.plan.plan import make_plan
    from shardfit.plan.shapes import resolve_shape
    from shardfit.plan.workload import Workload
    from shardfit.resolve import fits
    from shardfit.strategy import get as get_strategy

    small = make_plan(resolve_shape("HuggingFaceTB/SmolLM2-135M-Instruct"), Workload(), parse_gpus("1x24GB"))
    assert small.candidate("single").fits and rules.plan_rules(small, get_strategy("single"), False) == []
    real = fits.memory_verdict

    def refusing(plan: object, strategy: str, cfg: object = None) -> fits.Verdict:
        return dataclasses.replace(real(plan, strategy, cfg), fits=False)

    monkeypatch.setattr(fits, "memory_verdict", refusing)
    monkeypatch.setattr(rules, "memory_verdict", refusing, raising=False)
    with pytest.raises(DoesNotFitError):
        fits.refuse_if_oom(small, "single", force=False)
    found = rules.plan_rules(small, get_strategy("single"), False)
    assert [f.rule for f in found] == ["predicted_oom"] and found[0].severity == "error", found


def test_check_refuses_two_node_counts_that_disagree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`check C --nodes 2 --nnodes 3` silently took 3 (one dest, last wins); two spellings that disagree are now
    exit 2 naming both, while the same count twice is taken."""
    with pytest.raises(SystemExit) as e:
        main(["check", str(tmp_path / "c.yaml"), "--nodes", "2", "--nnodes", "3"])
    assert e.value.code == 2
    assert "--nodes 2 and --nnodes 3 disagree" in capsys.readouterr().err
    from shardfit.cli.main import build_parser

    args = build_parser().parse_args(["check", "c.yaml", "--nodes", "2", "--nnodes", "2"])
    assert args.nodes == 2


def test_the_predicted_oom_refusal_is_in_the_same_words_from_check_and_train(tmp_path: Path, small_data: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """check said `predicted not to fit: ...` with a fix, train `strategy single is predicted not to fit: ...`
    without one (and where the plan's notes give no total, check named the figure and train did not): one function
    (resolve/fits.py `oom_refusal`) now writes it, and train's refusal is check's finding, where, message and fix."""
    cfg = str(write_config(tmp_path / "c.yaml", model="meta-llama/Llama-3.1-70B", data=str(small_data),
                           strategy="single", method="full", max_seq_len=512, micro_batch=1, max_steps=1,
                           output_dir=str(tmp_path / "run")))
    code = main(["check", cfg, "--json"])
    found = {f["rule"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    oom = found["predicted_oom"]
    assert code == 1 and oom["severity"] == "error" and oom["message"].startswith("predicted "), oom
    train = _run(["train", cfg], capsys)
    assert train[0] == 3, train
    line = f"{oom['where']}; {oom['message']} (fix: {oom['fix']}; or set force: true to start anyway)"
    assert line in train[1], (line, train[1][-1500:])


@pytest.mark.parametrize(("key", "absent", "refusal"), [
    ("data", "/nonexistent/data/train.jsonl", "'data' file not found: /nonexistent/data/train.jsonl"),
    ("eval_data", "/nonexistent/data/held.jsonl", "'eval_data' file not found: /nonexistent/data/held.jsonl"),
    ("model", "/nonexistent/models/llama", "'model': /nonexistent/models/llama does not exist"),
    ("model", "~/nonexistent-shardfit-model.gguf", "'model': ~/nonexistent-shardfit-model.gguf does not exist"),
], ids=["data", "eval-data", "model-folder", "model-gguf"])
def test_a_data_file_or_model_absent_here_is_a_warning_of_check(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                                capsys: pytest.CaptureFixture, key: str,
                                                                absent: str, refusal: str) -> None:
    """A data file or local model with nothing at it where check runs (a login node without the cluster's
    storage) was exit 2 from check, stopping every other rule, where an absent `resume:` path is a warning: the
    same rule now holds for all three. check warns naming the machine it looked on and that train refuses unless
    the path is there where it trains (exit 0, the other rules run); train still refuses it (exit 2)."""
    import socket

    keys = {"data": small_data, "model": tiny_llama, key: absent}
    # max_bad_rows: the data that is here is read (small_data has rows too long for 64 tokens)
    cfg = str(_config(tmp_path, keys.pop("model"), keys.pop("data"), max_bad_rows=64, **keys))
    code = main(["check", cfg, "--json"])
    said = capsys.readouterr()
    assert said.out.startswith("{"), said.err[-2000:]
    found = {f["rule"]: f for f in json.loads(said.out)["findings"]}
    rule = "model_not_here" if key == "model" else "data_not_here"
    assert code == 0 and found[rule]["severity"] == "warning", said.out
    assert found[rule]["where"] == f"config: {key}"
    assert f"'{key}': {absent} does not exist on {socket.gethostname()}, the machine check ran on" \
        in found[rule]["message"] and "train refuses the run (exit 2) unless" in found[rule]["message"]
    assert "srun -N1 shardfit check CONFIG" in found[rule]["fix"]
    code, out = _run(["train", cfg], capsys)
    assert code == 2 and refusal in out and "Traceback" not in out, out


@pytest.mark.parametrize(("key", "value", "want"), [
    ("data", "~shardfit-no-such-user/d.jsonl", "'data' names the home of a user"),
    ("data", "{tmp}/" + "d" * 300 + ".jsonl", "'data' {tmp}/" + "d" * 300 + ".jsonl cannot be read on "),
    ("data", "https://example.com/train.jsonl", "'data' is a URL (https://example.com/train.jsonl)"),
    ("model", "/nonexistent/model.safetensors", "'model': /nonexistent/model.safetensors names a .safetensors file"),
    ("model", "~shardfit-no-such-user/llama", "'model': ~shardfit-no-such-user/llama names the home of a user"),
    ("model", "{tmp}/" + "m" * 300, "'model': {tmp}/" + "m" * 300 + " cannot be read on "),
], ids=["data-unknown-user", "data-name-too-long", "data-url", "model-safetensors", "model-unknown-user",
        "model-name-too-long"])
def test_a_malformed_data_or_model_path_is_exit_2_from_check_and_train(tmp_path: Path, tiny_llama: Path,
                                                                       small_data: Path,
                                                                       capsys: pytest.CaptureFixture, key: str,
                                                                       value: str, want: str) -> None:
    """A path that could be no file on any machine is no warning: exit 2 from both, naming the key (an unknown
    user's home and a name too long were Path's RuntimeError and OSError, the last guard's exit 1)."""
    value, want = value.format(tmp=tmp_path), want.format(tmp=tmp_path)
    keys = {"data": small_data, "model": tiny_llama, key: value}
    cfg = str(_config(tmp_path, keys.pop("model"), keys.pop("data"), **keys))
    check = _run(["check", cfg], capsys)
    train = _run(["train", cfg], capsys)
    assert check[0] == train[0] == 2, (check, train)
    assert want in check[1] and want in train[1], (check[1][-800:], train[1][-800:])
    assert "Traceback" not in check[1] + train[1]


def test_check_and_train_name_one_job_for_two_nodes(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                   capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`check --nproc 2 --nodes 2` and `train --nproc 2 --nnodes 2` on this machine: train said only `strategy
    auto -> X on 2 processes per node` before it launched, and check's job line named neither the world size nor
    the micro-batch (and measured a CPU's rates at its own threads, not the ranks'). Both now give one job line,
    strategy, ranks and micro-batch; train's is logged before it launches (the launch is stubbed here)."""
    import shardfit.parallel.launch as launch

    launched = []
    monkeypatch.setattr(launch, "relaunch", lambda cmd, env: launched.append(cmd) or 0)
    cfg = str(_config(tmp_path, tiny_llama, small_data, max_bad_rows=64))
    assert main(["check", cfg, "--nproc", "2", "--nodes", "2"]) == 0
    checked = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("job: "))
    assert "2 processes x 2 nodes, 4 ranks" in checked and checked.endswith(", micro-batch 2"), checked
    with caplog.at_level("INFO", logger="shardfit"):
        assert main(["train", cfg, "--nproc", "2", "--nnodes", "2", "--master-addr", "10.0.0.1"]) == 0
    assert launched and "--nnodes=2" in launched[0] and "--nproc-per-node=2" in launched[0], launched
    said = [r.getMessage() for r in caplog.records]
    assert checked in said, (checked, said)
