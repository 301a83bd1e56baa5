"""Every `shardfit` command the README shows runs as shown: the README cannot drift from the CLI.

Commands run from the repository root, as a user who cloned it would. Where a command would be slow here it runs
on a tiny stand-in: `train` gets a tiny model, fp32, short rows and one step; `--nproc 8` becomes 2 ranks. Files the
commands name are shipped in examples/."""

from __future__ import annotations

import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_cli

README = ROOT / "README.md"
# Commands that cannot run on one CI machine, with the test that covers what they do instead.
NOT_HERE = {"--nnodes": "two nodes: tests/test_distributed.py::test_two_node_launch_matches_single_process"}


def readme_commands() -> list[list[str]]:
    """The `shardfit ...` lines of the README's bash blocks, without comments, as argument lists."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    out = []
    for block in blocks:
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("shardfit "):
                out.append(shlex.split(line)[1:])
    return out


def test_the_readme_shows_the_main_commands() -> None:
    commands = {c[0] for c in readme_commands()}
    assert {"train", "plan", "check", "diagnose"} <= commands, commands
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def _stand_in(args: list[str], model: Path, out: Path) -> list[str]:
    """The README command, made cheap: tiny model and one step for train, two ranks for --nproc 8, runs in tmp."""
    args = ["2" if a == "8" and i and args[i - 1] == "--nproc" else a for i, a in enumerate(args)]
    args = [str(out / "plan.png") if a == "plan.png" else a for a in args]
    if args[0] == "train":
        args += ["--set", f"model={model}", "--set", "max_steps=1", "--set", "precision=fp32", "--set",
                 "max_seq_len=128", "--set", "micro_batch=2", "--set", "grad_accum=1", "--set", "grad_ckpt=none",
                 "--set", "eval_split=0", "--set", f"output_dir={out / 'runs' / 'demo'}", "--set", "resume=never"]
    # The run that `train` just wrote lives in tmp: every later command that names runs/... reads it there.
    return [str(out / a) if a.startswith("runs/") else a for a in args]


# The commands that only read and print run in this process (the CLI's own `main`, from the repository root), which
# saves a start-up each, and so does `train` on one process; `train --nproc` and `doctor` (which launch ranks) run as
# a user runs them, in a new process.
IN_PROCESS = {"plan", "check", "eval", "report", "diagnose"}


def in_process(args: list[str]) -> bool:
    """Whether the README command `args` runs through `main` in this process: it launches no ranks."""
    return args[0] in IN_PROCESS or (args[0] == "train" and "--nproc" not in args)


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from shardfit.cli.main import main

    monkeypatch.chdir(ROOT)
    ran = 0
    for args in readme_commands():
        if any(flag in args for flag in NOT_HERE):
            continue
        cmd = _stand_in(args, tiny_llama, tmp_path)
        if in_process(args):
            capsys.readouterr()
            code, err = main(cmd), capsys.readouterr().err
        else:
            r = run_cli(*cmd, cwd=ROOT, timeout=600, env={"OMP_NUM_THREADS": "1"})
            code, err = r.returncode, r.stderr
        # plan's exit 3 (nothing fits) is an answer, not a failure; check's 1 is a finding.
        allowed = {0, 3} if args[0] == "plan" else {0, 1} if args[0] == "check" else {0}
        assert code in allowed, (" ".join(cmd), err[-2000:])
        # Neither a traceback nor the last guard's line (an exception the command did not expect).
        assert "Traceback" not in err and "error: unexpected" not in err, (" ".join(cmd), err[-2000:])
        ran += 1
    assert ran >= 6


# Pages whose shown plans may be an excerpt of the pipeline table alone (no strategy rows to hold).
EXCERPT_PAGES = {"pipeline.md", "long-context.md"}


def shown_plans() -> list[tuple[str, list[str], list[str]]]:
    """(file, the `shardfit plan --model ...` command, the table rows of the output block under it) of every plan
    the README, docs/models.md, docs/planning.md, docs/pipeline.md and docs/long-context.md show. The last two also
    show excerpts of the pipeline layouts alone, without strategy rows: those are left out."""
    out = []
    docs = ROOT / "docs"
    for path in (README, docs / "models.md", docs / "planning.md", docs / "pipeline.md", docs / "long-context.md"):
        for cmd, shown in re.findall(r"```bash\n(shardfit plan --model [^\n]*)\n```\n\n```\n(.*?)```", path.read_text(),
                                     re.S):
            rows = [line for line in shown.splitlines() if re.match(r"(single|ddp|zero2|zero3|zero3_offload|"
                                                                     r"model_parallel)\s", line)]
            if rows or path.name not in EXCERPT_PAGES:
                out.append((path.name, shlex.split(cmd)[1:], rows))
    return out


@pytest.mark.parametrize("file,args,rows", shown_plans(), ids=lambda v: v if isinstance(v, str) else None)
def test_shown_plans_are_what_plan_prints(file: str, args: list[str], rows: list[str],
                                          capsys: pytest.CaptureFixture) -> None:
    """A plan table in the README or the docs is the planner's output today: a change to the planner that moves a
    number makes this fail until the shown output is pasted again."""
    from shardfit.cli.main import main

    assert rows, f"{file}: no table rows under {' '.join(args)}"
    if "--plot" in args:  # the picture is not the table: it would land in the working directory
        i = args.index("--plot")
        args = args[:i] + args[i + 2:]
    main(args)
    printed = {" ".join(line.split()) for line in capsys.readouterr().out.splitlines()}
    for row in rows:
        assert " ".join(row.split()) in printed, f"{file}: {row!r} is not what `shardfit {' '.join(args)}` prints"


# The README is the five-minute front page; depth belongs in docs/ (a sentence and a link here).
README_MAX_LINES = 250


def test_the_readme_stays_a_front_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, more than {README_MAX_LINES}: move the depth "
                                       "into the matching docs/*.md page and leave a sentence and a link")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page`: lower case, punctuation but `-` and `_` dropped, spaces to
    `-`, a repeated heading numbered `-1`, `-2`, ..."""
    anchors, repeats = set(), Counter()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{repeats[slug]}" if repeats[slug] else slug)
        repeats[slug] += 1
    return anchors


def readme_links() -> list[str]:
    """The README's relative link targets (pages, anchors, pictures); web addresses left out."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", README.read_text()) if not re.match(r"[a-z]+:", t)]


def test_the_readme_links_resolve() -> None:
    """Every relative link of the README names a file that exists and, after `#`, a heading of that page."""
    links = readme_links()
    assert len(links) >= 20, links
    bad = []
    for link in links:
        target, _, anchor = link.partition("#")
        path = ROOT / target if target else README
        if not path.is_file():
            bad.append(f"{link}: no file {target}")
        elif anchor and anchor not in _anchors(path):
            bad.append(f"{link}: {target or 'README.md'} has no heading with the anchor #{anchor}")
    assert not bad, "\n".join(bad)


def test_anchors_are_githubs() -> None:
    """The anchor rule gives GitHub's anchors for headings with code, punctuation and repeats."""
    page = ROOT / "docs" / "reference.md"
    anchors = _anchors(page)
    assert {"config-keys", "shardfit-plan---json", "benchresultslatestjson"} <= anchors, sorted(anchors)[:20]
    assert "the-demo-make-demo" in _anchors(ROOT / "docs" / "training.md")
    assert "no-such-heading" not in anchors
