"""The UI's HTTP server: routes to the plan, the runs' reports and the jobs it launched. It binds to the loopback
address by default: it launches training processes, so it is for the person at this machine."""

from __future__ import annotations

import base64
import dataclasses
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.render import format_table, plot
from shardfit.plan.shapes import catalog, resolve_shape
from shardfit.plan.workload import Workload
from shardfit.report.build import finished, make_report
from shardfit.ui import pages


@dataclass
class Job:
    """A `shardfit train` the UI started, its output in a log file."""

    config: str
    command: list[str]
    log: Path
    run_name: str | None
    proc: subprocess.Popen = field(repr=False)

    def state(self) -> str:
        rc = self.proc.poll()
        return "running" if rc is None else ("finished" if rc == 0 else f"failed (exit {rc})")

    def log_tail(self, n: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        # tqdm redraws its bar with carriage returns: keep what the terminal would show last on each line
        return "\n".join(line.rsplit("\r", 1)[-1] for line in text.splitlines()[-n:])


class UI:
    """The state behind the pages: where runs live and the jobs started from here."""

    def __init__(self, runs_root: Path):
        self.runs_root = runs_root
        self.jobs: dict[int, Job] = {}
        self.lock = threading.Lock()
        self.drawing = threading.Lock()  # matplotlib's pyplot is not thread-safe; requests come on threads
        self.models = sorted(catalog())

    def runs(self) -> list[Path]:
        if not self.runs_root.is_dir():
            return []
        return sorted(p for p in self.runs_root.iterdir() if (p / "metrics.jsonl").is_file()
                      or (p / "config.yaml").is_file())

    def plan(self, q: dict[str, str]) -> str:
        w = dataclasses.replace(Workload(), method=q.get("method", "lora"), precision="bf16",
                                seq_len=_int(q, "seq", 2048), micro_batch=_int(q, "batch", 1),
                                grad_ckpt=q.get("grad_ckpt", "full"))
        shape = resolve_shape(q.get("model", "").strip())
        plan = make_plan(shape, w, parse_gpus(q.get("gpus", "1x24GB"), _int(q, "nodes", 1)))
        with tempfile.TemporaryDirectory() as tmp, self.drawing:
            plot(plan, f"{tmp}/plan.png")
            png = base64.b64encode(Path(tmp, "plan.png").read_bytes()).decode()
        note = f"recommended: {plan.recommended}" if plan.recommended else "nothing fits (exit code 3 in the CLI)"
        return pages.plan_page(self.models, q, format_table(plan), png, note)

    def launch(self, config: str, nproc: int) -> int:
        cfg = load_config(config)  # a bad config is reported on the page, before any process starts
        run_dir = Path(cfg.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "shardfit", "train", config, "--nproc", str(nproc)]
        log = run_dir / "ui-train.log"
        with log.open("w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        name = run_dir.resolve().name if run_dir.resolve().parent == self.runs_root.resolve() else None
        with self.lock:
            job_id = len(self.jobs) + 1
            self.jobs[job_id] = Job(config, command, log, name, proc)
        return job_id

    def report(self, name: str) -> str:
        run = self.runs_root / name
        if "/" in name or name.startswith(".") or not run.is_dir():
            raise UserError(f"no run named {name} under {self.runs_root}")
        with self.drawing:
            page = make_report([str(run)], str(run / "report"), refresh_s=None if finished(str(run)) else 10)
            return page.read_text()


def _int(q: dict[str, str], key: str, default: int) -> int:
    try:
        return int(q.get(key) or default)
    except ValueError:
        raise UserError(f"{key}: {q[key]!r} is not a whole number.") from None


def handler(ui: UI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            """No access log: the terminal shows the URL once."""

        def _send(self, body: str, status: HTTPStatus = HTTPStatus.OK, location: str | None = None) -> None:
            data = body.encode()
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str, q: dict[str, str]) -> None:
            path = urlparse(self.path).path
            try:
                if method == "GET" and path == "/":
                    return self._send(pages.home(ui.models, ui.runs(), ui.jobs))
                if method == "GET" and path == "/plan":
                    return self._send(ui.plan(q))
                if method == "GET" and path.startswith("/runs/"):
                    return self._send(ui.report(unquote(path[len("/runs/"):]).strip("/")))
                if method == "GET" and path.startswith("/jobs/") and path[6:].isdigit() and int(path[6:]) in ui.jobs:
                    return self._send(pages.job_page(int(path[6:]), ui.jobs[int(path[6:])]))
                if method == "POST" and path == "/launch":
                    job_id = ui.launch(q.get("config", "").strip(), _int(q, "nproc", 1))
                    return self._send("", HTTPStatus.SEE_OTHER, f"/jobs/{job_id}")
                self._send(pages.error_page("not found", self.path), HTTPStatus.NOT_FOUND)
            except UserError as e:
                self._send(pages.error_page("cannot do that", str(e)), HTTPStatus.BAD_REQUEST)

        def do_GET(self) -> None:
            self._route("GET", {k: v[-1] for k, v in parse_qs(urlparse(self.path).query).items()})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            self._route("POST", {k: v[-1] for k, v in form.items()})

    return Handler


def make_server(runs_root: Path, host: str = "127.0.0.1", port: int = 7860) -> ThreadingHTTPServer:
    """The server, bound and ready for `serve_forever` (port 0: any free port)."""
    try:
        return ThreadingHTTPServer((host, port), handler(UI(runs_root)))
    except OSError as e:
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e}); pick another port.") from None
