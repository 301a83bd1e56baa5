"""The UI's HTTP server: routes to the plan, the runs' reports and the jobs it launched. It binds to the loopback
address by default and answers only requests that show its token (see guard.py): it launches training processes,
so it is for the person who started it.

It stays on the standard library's `http.server`: the pages are a handful of forms, and what a server stack would
add is bounded here explicitly and tested (tests/test_ui.py): body size and its declared length (guard.py), a read
timeout on every socket, a deadline for a whole body, a cap on concurrent connections, and no traceback for a
malformed request (a status line for each kind: tests/test_bad_inputs_round3.py). docs/security.md says why
werkzeug's server would not add these and uvicorn would cost more than it gives here.
"""

from __future__ import annotations

import base64
import dataclasses
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from shardfit.config import load_config
from shardfit.config.schema import GRAD_CKPT, METHODS
from shardfit.errors import UserError
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import Plan, make_plan
from shardfit.plan.render import plot
from shardfit.plan.shapes import catalog, resolve_shape
from shardfit.plan.workload import model_workload
from shardfit.report.build import finished, make_report
from shardfit.ui import pages
from shardfit.ui.guard import (
    BODY_DEADLINE_S,
    READ_TIMEOUT_S,
    TOKEN_FIELD,
    TOKEN_HEADER,
    WILDCARD_HOSTS,
    Guard,
    Refused,
    content_length,
    new_token,
    read_body,
)

MAX_CONNECTIONS = 32  # one thread each; past this a connection is answered 503 at once instead of queueing a thread
MAX_FIELDS = 64  # query or form fields per request; the pages send at most eight
# Every page is the server's own HTML with inline style and data: images: nothing else may load, nothing may frame
# it (a framed page could be clicked through by another site), forms go back to this server only.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # page URLs can carry the token
    "Cache-Control": "no-store",
}


@dataclass
class Job:
    """A `shardfit train` the UI started, its output in a log file."""

    config: str
    command: list[str]
    log: Path
    run_name: str | None
    proc: subprocess.Popen = field(repr=False)

    def state(self) -> str:
        """running, finished, or failed with the exit code."""
        rc = self.proc.poll()
        return "running" if rc is None else ("finished" if rc == 0 else f"failed (exit {rc})")

    def log_tail(self, n: int = 40) -> str:
        """The last `n` lines of the job's output as a terminal would show them."""
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        # tqdm redraws its bar with carriage returns: keep what the terminal would show last on each line
        return "\n".join(line.rsplit("\r", 1)[-1] for line in text.splitlines()[-n:])


class UI:
    """The state behind the pages: where runs live, the configs it may launch, and the jobs started from here."""

    def __init__(self, runs_root: Path, configs: Iterable[Path] = ()):
        self.runs_root = runs_root
        self.configs = [Path(c).expanduser().resolve() for c in configs]
        self.jobs: dict[int, Job] = {}
        self.lock = threading.Lock()
        self.drawing = threading.Lock()  # matplotlib's pyplot is not thread-safe; requests come on threads
        self.models = sorted(catalog())

    def runs(self) -> list[Path]:
        """The run directories under the runs folder."""
        if not self.runs_root.is_dir():
            return []
        return sorted(p for p in self.runs_root.iterdir() if (p / "metrics.jsonl").is_file()
                      or (p / "config.yaml").is_file())

    def plan_of(self, q: dict[str, str]) -> Plan:
        """The plan for the form's values: `shardfit plan --model` with the same flags (its workload, its kernels)."""
        w = dataclasses.replace(model_workload(), method=_choice(q, "method", METHODS, "lora"), precision="bf16",
                                seq_len=_int(q, "seq", 2048), micro_batch=_int(q, "batch", 1),
                                grad_ckpt=_choice(q, "grad_ckpt", GRAD_CKPT, "full"))
        shape = resolve_shape(q.get("model", "").strip())
        return make_plan(shape, w, parse_gpus(q.get("gpus", "1x24GB"), _int(q, "nodes", 1)))

    def plan(self, q: dict[str, str]) -> str:
        """The plan page for the form's values."""
        plan = self.plan_of(q)
        with tempfile.TemporaryDirectory() as tmp, self.drawing:
            plot(plan, f"{tmp}/plan.png")
            png = base64.b64encode(Path(tmp, "plan.png").read_bytes()).decode()
        note = f"recommended: {plan.recommended}" if plan.recommended else "nothing fits (exit code 3 in the CLI)"
        return pages.plan_page(self.models, q, plan, png, note)

    def launchable(self, config: str) -> Path:
        """The config file `config` names, when the UI may launch it: under the runs folder or passed with
        --config. Decided from the path alone: a refused file is never opened, so no error can show its text."""
        if not config:
            raise UserError("config: give the path of a config file under the runs folder.")
        try:
            # resolve() follows symlinks: a link under the runs folder to a file elsewhere is elsewhere
            path = Path(config).expanduser().resolve()
        except (OSError, ValueError, RuntimeError):
            raise UserError(f"config {config!r} is not a usable path.") from None
        if path.is_relative_to(self.runs_root.resolve()) or path in self.configs:
            return path
        raise UserError(f"config {config}: the UI launches only configs under its runs folder "
                        f"({self.runs_root}) or passed with `shardfit ui --config FILE`; move the config there or "
                        "restart the UI with --config naming it.")

    def launch(self, config: str, nproc: int) -> int:
        """Start `shardfit train` on an allowed config; the job's number."""
        path = self.launchable(config)
        if nproc < 1:
            raise UserError(f"ranks: {nproc} is not a rank count; give 1 or more.")
        cfg = load_config(path)  # a bad config is reported on the page, before any process starts
        if cfg.trust_remote_code and path not in self.configs:
            # A config under the runs folder may have come with a run directory someone handed over: letting a
            # model folder's Python run takes the user's own word on a command line.
            raise UserError(f"config {config} sets trust_remote_code: true; the UI launches such a config only when "
                            "it was named with `shardfit ui --config FILE`. Run `shardfit train` on it yourself, or "
                            "restart the UI with --config naming it, if you trust its model folder.")
        run_dir = Path(cfg.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "shardfit", "train", str(path), "--nproc", str(nproc)]
        log = run_dir / "ui-train.log"
        with log.open("w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        name = run_dir.resolve().name if run_dir.resolve().parent == self.runs_root.resolve() else None
        with self.lock:
            job_id = len(self.jobs) + 1
            self.jobs[job_id] = Job(config, command, log, name, proc)
        return job_id

    def report(self, name: str) -> str:
        """The live report of the run `name` under the runs folder."""
        run = self.runs_root / name
        if "/" in name or name.startswith(".") or not run.is_dir():
            raise UserError(f"no run named {name} under {self.runs_root}")
        with self.drawing:
            page = make_report([str(run)], str(run / "report"), refresh_s=None if finished(str(run)) else 10)
            return page.read_text()


# The forms' numbers and the range each may take: outside it a plan or a launch means nothing (a batch of 0, a
# sequence of 10**20 tokens) or fails deep inside the planner.
LIMITS = {"seq": (1, 1 << 20), "batch": (1, 4096), "nodes": (1, 4096), "nproc": (1, 1024)}


def _int(q: dict[str, str], key: str, default: int) -> int:
    """A form's whole number within LIMITS; a UserError (400, the page says which field) otherwise."""
    text = q.get(key) or str(default)
    lo, hi = LIMITS[key]
    if not (text.isascii() and text.strip().lstrip("-").isdigit() and len(text.strip()) <= 20):
        raise UserError(f"{key}: {text[:40]!r} is not a whole number; give {lo} to {hi}.")
    value = int(text)
    if not lo <= value <= hi:
        raise UserError(f"{key}: {value} is out of range; give {lo} to {hi}.")
    return value


def _choice(q: dict[str, str], key: str, options: tuple[str, ...], default: str) -> str:
    value = q.get(key) or default
    if value not in options:
        raise UserError(f"{key}: {value[:40]!r} is not one of {', '.join(options)}.")
    return value


def _fields(text: str) -> dict[str, str]:
    """Query or form fields, the last value of each; 400 past MAX_FIELDS."""
    try:
        return {k: v[-1] for k, v in parse_qs(text, max_num_fields=MAX_FIELDS).items()}
    except ValueError:
        raise Refused(HTTPStatus.BAD_REQUEST, f"more than {MAX_FIELDS} fields.") from None


class Server(ThreadingHTTPServer):
    """A threading server with a cap on concurrent connections and one-line error logging."""

    daemon_threads = True
    guard: Guard
    ui: UI
    url: str

    def __init__(self, address: tuple[str, int], handler_class: type[BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS, body_deadline_s: float = BODY_DEADLINE_S):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.slots = threading.BoundedSemaphore(max_connections)
        self.body_deadline_s = body_deadline_s
        super().__init__(address, handler_class)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Stalled clients each hold a thread until their read times out; past the cap, answer at once rather than
        # let them pile up threads (the accept loop itself never blocks on a client).
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line on stderr instead of socketserver's traceback; a client that went away is not an error."""
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError)):
            print(f"shardfit ui: a request from {client_address[0]} failed: {type(error).__name__}: {error}",
                  file=sys.stderr)


class Handler(BaseHTTPRequestHandler):
    """Every request passes the guard before it reaches a page."""

    # StreamRequestHandler.setup puts this timeout on the socket: a read that stalls this long ends the
    # request (http.server drops it when the request line or headers stall; the body answers 408).
    timeout = READ_TIMEOUT_S
    set_cookie = False
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: the terminal shows the URL once."""

    @property
    def guard(self) -> Guard:
        return self.server.guard

    def _send(self, body: str, status: HTTPStatus = HTTPStatus.OK, location: str | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        if self.set_cookie:
            self.send_header("Set-Cookie", self.guard.set_cookie())
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, refused: Refused) -> None:
        self.close_connection = True  # whatever of the request is still unread must not be taken as the next
        self._send(pages.error_page(f"{refused.status.value} {refused.status.phrase}", refused.reason),
                   refused.status)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own answers to a malformed request (400, 414, 431, 501, 505): always with a status line.
        A request line it cannot parse leaves the request taken as HTTP/0.9, which would get a bare page."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        super().send_error(code, message, explain)

    def _url(self) -> Any:
        """The request's path and query; 400 for a target urllib cannot split (an unclosed [IPv6] host)."""
        try:
            return urlparse(self.path)
        except ValueError:
            raise Refused(HTTPStatus.BAD_REQUEST, "the request target is not a URL path.") from None

    def _route(self, method: str, q: dict[str, str]) -> None:
        ui, path = self.server.ui, self._url().path
        try:
            if method == "GET" and path == "/":
                return self._send(pages.home(ui.models, ui.runs(), ui.jobs, self.guard.token, ui.configs))
            if method == "GET" and path == "/plan":
                return self._send(ui.plan(q))
            if method == "GET" and path.startswith("/runs/"):
                return self._send(ui.report(unquote(path[len("/runs/"):]).strip("/")))
            if method == "GET" and path.startswith("/jobs/") and path[6:].isdigit() and int(path[6:]) in ui.jobs:
                return self._send(pages.job_page(int(path[6:]), ui.jobs[int(path[6:])]))
            if method == "POST" and path == "/launch":
                job_id = ui.launch(q.get("config", "").strip(), _int(q, "nproc", 1))
                return self._send("", HTTPStatus.SEE_OTHER, f"/jobs/{job_id}")
            if path == "/launch":
                return self._send(pages.error_page("use the form", "a run is launched by the form's POST only."),
                                  HTTPStatus.METHOD_NOT_ALLOWED)
            self._send(pages.error_page("not found", self.path), HTTPStatus.NOT_FOUND)
        except UserError as e:
            self._send(pages.error_page("cannot do that", str(e)), HTTPStatus.BAD_REQUEST)
        except Exception as e:  # noqa: BLE001 - a page that fails says so; the server goes on serving
            print(f"shardfit ui: {method} {path} failed: {type(e).__name__}: {e}", file=sys.stderr)
            self._send(pages.error_page("failed", f"{type(e).__name__}: {e}"), HTTPStatus.INTERNAL_SERVER_ERROR)

    def do_GET(self) -> None:
        """Pages: the token comes in the query (then a cookie is set) or in the cookie."""
        try:
            self.guard.check_host(self.headers.get("Host"))
            q = _fields(self._url().query)
            self.set_cookie = self.guard.token_ok(q.pop(TOKEN_FIELD, None))
            if not (self.set_cookie or self.guard.token_ok(self.guard.cookie_token(self.headers.get("Cookie")))):
                raise Refused(HTTPStatus.FORBIDDEN, "no valid token: open the URL `shardfit ui` printed (it "
                                                    "ends in ?token=...).")
        except Refused as refused:
            return self._refuse(refused)
        self._route("GET", q)

    def do_POST(self) -> None:
        """Changes: the token must be in the form or a header (another local page's form may carry the cookie,
        never the token) and a browser's Origin must be this server."""
        try:
            self.guard.check_host(self.headers.get("Host"))
            self.guard.check_origin(self.headers.get("Origin"))
            self._url()
            body = read_body(self.rfile, content_length(self.headers), self.server.body_deadline_s)
            try:
                form = _fields(body.decode("utf-8"))
            except UnicodeDecodeError:
                raise Refused(HTTPStatus.BAD_REQUEST, "the form is not UTF-8.") from None
            if not self.guard.token_ok(form.pop(TOKEN_FIELD, None) or self.headers.get(TOKEN_HEADER)):
                raise Refused(HTTPStatus.FORBIDDEN, "no valid token in the form: launch from the UI's own page "
                                                    "(the cookie alone is not enough to change anything).")
        except Refused as refused:
            return self._refuse(refused)
        self._route("POST", form)


def display_url(host: str, port: int, token: str) -> str:
    """The URL to open: the bound address (this machine's loopback for a wildcard bind) with the token."""
    shown = "127.0.0.1" if host.strip("[]") in WILDCARD_HOSTS else host
    shown = f"[{shown.strip('[]')}]" if ":" in shown else shown
    return f"http://{shown}:{port}/?{TOKEN_FIELD}={token}"


def make_server(runs_root: Path, host: str = "127.0.0.1", port: int = 7860, *, configs: Iterable[Path] = (),
                token: str | None = None, read_timeout_s: float = READ_TIMEOUT_S,
                body_deadline_s: float = BODY_DEADLINE_S, max_connections: int = MAX_CONNECTIONS) -> Server:
    """The server, bound and ready for `serve_forever` (port 0: any free port); `server.url` is what to open."""
    ui = UI(runs_root, configs)
    try:
        # a subclass per server: the read timeout is a class attribute that StreamRequestHandler.setup reads
        handler = type("Handler", (Handler,), {"timeout": read_timeout_s})
        server = Server((host.strip("[]"), port), handler, max_connections, body_deadline_s)
    except OSError as e:
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e}); pick another port.") from None
    bound_port = server.server_address[1]
    server.ui = ui
    server.guard = Guard(token or new_token(), host, bound_port)
    server.url = display_url(host, bound_port, server.guard.token)
    return server
