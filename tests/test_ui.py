"""`shardfit ui`: the local server's plan calculator, run reports and a run launched from a config, checked over
HTTP and in a real headless browser; and what keeps other web pages and other clients from driving it (token,
Host, Origin, launchable configs, request limits), table-driven, with the cross-site attack replayed in Chromium."""

from __future__ import annotations

import functools
import http.cookiejar
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import shardfit.ui.server as server_module
from shardfit.ui.guard import MAX_BODY
from shardfit.ui.server import Server, make_server
from tests.helpers import DEMO_DATA, ROOT, browser, browser_dom, make_run, write_config

needs_browser = pytest.mark.skipif(browser() is None, reason="needs Chromium (apt-get install "
                                                             "chromium-headless-shell)")
SECRET = "root:$6$not-a-real-hash-but-secret:19000:0:99999:7:::"


@dataclass
class Served:
    """A running UI server and what a test needs of it."""

    server: Server
    runs: Path
    allowed: Path  # a config outside runs/, passed as if with `shardfit ui --config`
    launched: list[list[str]] = field(default_factory=list)  # every command the UI started
    configs_read: list[str] = field(default_factory=list)  # every config file the UI opened

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return self.server.guard.token

    def url(self, path: str, **query: str) -> str:
        """`path` on this server with the token in the query (as the printed URL carries it)."""
        return f"{self.base}{path}?{urllib.parse.urlencode({**query, 'token': self.token})}"


def _serve(server: Server) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


@pytest.fixture()
def ui(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The UI on a free port, its runs folder empty, with `subprocess.Popen` and `load_config` of the server
    recorded: a launch is seen without training anything, and a refused config is seen never to be opened."""
    runs = tmp_path / "runs"
    runs.mkdir()
    allowed = write_config(tmp_path / "allowed.yaml", model="HuggingFaceTB/SmolLM2-135M-Instruct",
                           data=str(DEMO_DATA), output_dir=str(runs / "allowed-run"))
    server = make_server(runs, port=0, configs=[allowed], read_timeout_s=1.0, body_deadline_s=3.0)
    served = Served(server, runs, allowed)

    class FakeProc:
        def __init__(self, command: list[str], **_: object):
            served.launched.append(command)

        def poll(self) -> int | None:
            return None

    real_load = server_module.load_config

    def recording_load(path: object, *args: object, **kwargs: object) -> object:
        served.configs_read.append(str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(server_module, "subprocess", types.SimpleNamespace(
        Popen=FakeProc, STDOUT=subprocess.STDOUT, DEVNULL=subprocess.DEVNULL))
    monkeypatch.setattr(server_module, "load_config", recording_load)
    _serve(server)
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def real_ui(tmp_path: Path) -> Iterator[Served]:
    """The UI as `shardfit ui` runs it: launches start real processes."""
    runs = tmp_path / "runs"
    runs.mkdir()
    server = make_server(runs, port=0)
    _serve(server)
    try:
        yield Served(server, runs, runs / "none.yaml")
    finally:
        server.shutdown()
        server.server_close()


def _open(url: str, data: bytes | None = None, headers: dict[str, str] | None = None,
          opener: urllib.request.OpenerDirector | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data else "GET")
    try:
        with (opener.open if opener else urllib.request.urlopen)(request, timeout=120) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def _get(url: str) -> tuple[int, str]:
    status, body, _ = _open(url)
    return status, body


def _raw(port: int, request: bytes, wait_s: float = 10.0) -> bytes:
    """What the server answers to these exact bytes (b'' when it closes without answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as c:
        c.sendall(request)
        out = b""
        try:
            while chunk := c.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def _status(answer: bytes) -> int | None:
    first = answer.split(b"\r\n", 1)[0].split()
    return int(first[1]) if len(first) > 1 and first[1].isdigit() else None


# ---- who may read the pages -------------------------------------------------------------------------------------

GET_CASES = [  # name, token in the query ("right", "wrong" or None), extra headers ({port}: the server's), status
    ("no token", None, {}, 403),
    ("a wrong token", "wrong", {}, 403),
    ("the token", "right", {}, 200),
    ("the token, under localhost", "right", {"Host": "localhost:{port}"}, 200),
    ("the token, under [::1]", "right", {"Host": "[::1]:{port}"}, 200),
    ("the token, a rebinding domain", "right", {"Host": "evil.example:{port}"}, 403),
    ("the token, a rebinding domain without port", "right", {"Host": "evil.example"}, 403),
    ("the token, another port", "right", {"Host": "127.0.0.1:1"}, 403),
    ("the token, a malformed Host", "right", {"Host": "127.0.0.1:{port}:x"}, 403),
    ("a wrong cookie", None, {"Cookie": "shardfit-ui-{port}=wrong"}, 403),
    ("another UI's cookie", None, {"Cookie": "shardfit-ui-1={token}"}, 403),
    ("the cookie", None, {"Cookie": "a=b; shardfit-ui-{port}={token}"}, 200),
]


@pytest.mark.parametrize(("name", "token", "headers", "status"), GET_CASES, ids=[c[0] for c in GET_CASES])
def test_pages_need_the_token_and_this_host(ui: Served, name: str, token: str | None, headers: dict[str, str],
                                            status: int) -> None:
    query = {"right": f"?token={ui.token}", "wrong": "?token=wrong", None: ""}[token]
    filled = {k: v.format(port=ui.port, token=ui.token) for k, v in headers.items()}
    got, body, _ = _open(f"{ui.base}/{query}", headers=filled)
    assert got == status, body
    assert (ui.token in body) == (status == 200)  # a refusal never shows the token (the home page's form does)


def test_the_token_sets_a_strict_cookie_that_keeps_links_working(ui: Served) -> None:
    jar = http.cookiejar.CookieJar()
    browser_like = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    status, home, headers = _open(f"{ui.base}/?token={ui.token}", opener=browser_like)
    assert status == 200
    cookie = headers["Set-Cookie"]
    assert cookie.startswith(f"shardfit-ui-{ui.port}={ui.token};")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert headers["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert f"name='token' value='{ui.token}'" in home  # the launch form carries it: a POST needs it in the body
    make_run(ui.runs / "exp1", mem=[[1.0, 1.0], [2.0, 1.2], [3.1, 1.3], [3.1, 1.3]], predicted=2.0)
    status, home = _open(f"{ui.base}/", opener=browser_like)[:2]  # no token in the URL: the cookie is enough
    assert status == 200 and "href='/runs/exp1'" in home
    assert _open(f"{ui.base}/runs/exp1", opener=browser_like)[0] == 200
    assert _get(f"{ui.base}/runs/exp1")[0] == 403  # and without it, nothing


# ---- who may launch a run ---------------------------------------------------------------------------------------

LAUNCH_CASES = [  # name, token placement, Origin ({port}: the server's), status, runs started
    ("token in the form, no Origin (a script)", "form", None, 303, 1),
    ("token in a header, no Origin", "header", None, 303, 1),
    ("token in the form, this server's Origin", "form", "http://127.0.0.1:{port}", 303, 1),
    ("token in the form, Origin under localhost", "form", "http://localhost:{port}", 303, 1),
    ("no token", None, None, 403, 0),
    ("a wrong token", "wrong", None, 403, 0),
    ("the cookie only, this server's Origin", "cookie", "http://127.0.0.1:{port}", 403, 0),
    ("token in the form, another site's Origin", "form", "http://evil.example", 403, 0),
    ("token in the form, another port's Origin", "form", "http://127.0.0.1:1", 403, 0),
    ("token in the form, an opaque Origin", "form", "null", 403, 0),
    ("token in the form, an https Origin", "form", "https://127.0.0.1:{port}", 403, 0),
]


@pytest.mark.parametrize(("name", "token", "origin", "status", "started"), LAUNCH_CASES,
                         ids=[c[0] for c in LAUNCH_CASES])
def test_launch_needs_the_token_in_the_request_and_this_origin(ui: Served, name: str, token: str | None,
                                                               origin: str | None, status: int,
                                                               started: int) -> None:
    config = write_config(ui.runs / "c.yaml", model="HuggingFaceTB/SmolLM2-135M-Instruct", data=str(DEMO_DATA),
                          output_dir=str(ui.runs / "from-ui"))
    form = {"config": str(config), "nproc": "1"}
    headers = {"Origin": origin.format(port=ui.port)} if origin else {}
    if token in ("form", "wrong"):
        form["token"] = ui.token if token == "form" else "wrong"
    elif token == "header":
        headers["X-Shardfit-Token"] = ui.token
    elif token == "cookie":
        headers["Cookie"] = f"shardfit-ui-{ui.port}={ui.token}"
    request = urllib.request.Request(f"{ui.base}/launch", data=urllib.parse.urlencode(form).encode(),
                                     headers=headers, method="POST")
    no_redirects = urllib.request.build_opener(type("NoRedirect", (urllib.request.HTTPRedirectHandler,),
                                                    {"redirect_request": lambda *a, **k: None}))
    try:
        with no_redirects.open(request, timeout=60) as r:
            got, location = r.status, r.headers.get("Location")
    except urllib.error.HTTPError as e:
        got, location = e.code, e.headers.get("Location")
    assert got == status
    assert len(ui.launched) == started
    if started:
        assert location == "/jobs/1" and ui.launched[0][-4:] == ["train", str(config.resolve()), "--nproc", "1"]


def test_launch_is_by_post_only(ui: Served) -> None:
    assert _get(ui.url("/launch", config=str(ui.allowed), nproc="1"))[0] == 405
    assert ui.launched == []


REFUSED_CONFIGS = [  # name, how the config is named (given the folder the secret file is in, and runs/)
    ("an absolute path outside runs/", lambda secret, runs: str(secret)),
    ("a relative path climbing out of runs/", lambda secret, runs: f"{runs}/../{secret.parent.name}/{secret.name}"),
    ("a symlink in runs/ to a file outside", lambda secret, runs: str(_link(runs / "innocent.yaml", secret))),
    ("a file that does not exist", lambda secret, runs: str(secret.parent / "missing.yaml")),
]


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


@pytest.mark.parametrize(("name", "naming"), REFUSED_CONFIGS, ids=[c[0] for c in REFUSED_CONFIGS])
def test_configs_outside_runs_are_refused_unread(ui: Served, tmp_path: Path, name: str, naming: object) -> None:
    secret = tmp_path / "private" / "shadow"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\nmore: lines\n")
    config = naming(secret, ui.runs)  # type: ignore[operator]
    form = urllib.parse.urlencode({"config": config, "nproc": "1", "token": ui.token}).encode()
    status, page, _ = _open(f"{ui.base}/launch", data=form)
    assert status == 400 and "runs folder" in page and "--config" in page
    assert SECRET not in page and "more: lines" not in page
    assert ui.configs_read == [] and ui.launched == []  # refused from the path: the file was never opened


def test_a_config_allowing_remote_code_launches_only_when_named_on_the_command_line(ui: Served) -> None:
    keys = dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", data=str(DEMO_DATA), trust_remote_code=True)
    handed = write_config(ui.runs / "handed.yaml", **keys, output_dir=str(ui.runs / "handed"))
    form = urllib.parse.urlencode({"config": str(handed), "nproc": "1", "token": ui.token}).encode()
    status, page, _ = _open(f"{ui.base}/launch", data=form)
    assert status == 400 and "sets trust_remote_code: true" in page and ui.launched == []
    write_config(ui.allowed, **keys, output_dir=str(ui.runs / "named"))  # the file passed with --config
    form = urllib.parse.urlencode({"config": str(ui.allowed), "nproc": "1", "token": ui.token}).encode()
    assert _open(f"{ui.base}/launch", data=form, headers={"Cookie": f"shardfit-ui-{ui.port}={ui.token}"})[0] == 200
    assert len(ui.launched) == 1


def test_a_config_passed_on_the_command_line_launches(ui: Served) -> None:
    form = urllib.parse.urlencode({"config": str(ui.allowed), "nproc": "2", "token": ui.token}).encode()
    status, page, _ = _open(f"{ui.base}/launch", data=form, headers={"Cookie": f"shardfit-ui-{ui.port}={ui.token}"})
    assert status == 200 and "job 1" in page  # the redirect to the job's page, followed with the cookie
    assert ui.launched[0][-4:] == ["train", str(ui.allowed.resolve()), "--nproc", "2"]


# ---- what one request may cost the server -----------------------------------------------------------------------

LIMIT_CASES = [  # name, headers after Host, body, status
    ("a body over the limit", f"Content-Length: {MAX_BODY + 1}\r\n", b"config=x", 413),
    ("a huge declared body", "Content-Length: 150000000000\r\n", b"", 413),
    ("a negative length", "Content-Length: -1\r\n", b"", 400),
    ("a length that is not a number", "Content-Length: abc\r\n", b"", 400),
    ("a length with a sign", "Content-Length: +5\r\n", b"a=b&c", 400),
    ("a length with an underscore", "Content-Length: 1_0\r\n", b"a=b&c=d&ef", 400),
    ("two different lengths", "Content-Length: 3\r\nContent-Length: 4\r\n", b"a=bc", 400),
    ("a chunked body", "Transfer-Encoding: chunked\r\n", b"3\r\na=b\r\n0\r\n\r\n", 400),
    ("a body shorter than its length", "Content-Length: 100\r\n", b"config=x", 408),
    ("a body that is not UTF-8", "Content-Length: 4\r\n", b"\xff\xfe\xfd\xfc", 400),
    ("too many fields", "Content-Length: {length}\r\n", b"&".join(b"f%03d=1" % i for i in range(67)), 400),
]


@pytest.mark.parametrize(("name", "headers", "body", "status"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_request_limits(ui: Served, name: str, headers: str, body: bytes, status: int) -> None:
    headers = headers.format(length=len(body))
    request = (f"POST /launch HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\nX-Shardfit-Token: {ui.token}\r\n{headers}"
               "\r\n").encode() + body
    start = time.monotonic()
    answer = _raw(ui.port, request)
    assert _status(answer) == status, answer[:300]
    assert time.monotonic() - start < 8  # answered within the read timeout (1 s here), never left waiting
    assert ui.launched == []


def test_a_trickled_body_meets_a_deadline(ui: Served) -> None:
    """One byte at a time, each within the read timeout: the whole body must still arrive within its deadline."""
    with socket.create_connection(("127.0.0.1", ui.port), timeout=10) as c:
        c.sendall(f"POST /launch HTTP/1.1\r\nHost: 127.0.0.1:{ui.port}\r\nContent-Length: 1000\r\n\r\n".encode())
        start = time.monotonic()
        answer = b""
        while time.monotonic() - start < 8:
            try:
                c.sendall(b"a")
            except OSError:
                break
            time.sleep(0.5)  # under the 1 s read timeout: only the 3 s body deadline can end this
            c.setblocking(False)
            try:
                answer += c.recv(65536)
            except BlockingIOError:
                pass
            finally:
                c.setblocking(True)
            if answer:
                break
    assert _status(answer) == 408 and time.monotonic() - start < 6


def test_stalled_connections_are_capped_and_dropped(tmp_path: Path) -> None:
    server = make_server(tmp_path, port=0, read_timeout_s=1.0, max_connections=2)
    _serve(server)
    port = server.server_address[1]
    try:
        stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        for c in stalled:
            c.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1")  # headers never finished
        time.sleep(0.3)  # both now hold a thread
        assert _status(_raw(port, b"GET / HTTP/1.0\r\n\r\n", wait_s=5)) == 503  # answered at once, not queued
        start = time.monotonic()
        assert [c.recv(100) for c in stalled] == [b"", b""]  # dropped after the read timeout
        assert time.monotonic() - start < 5
        time.sleep(0.3)
        assert _status(_raw(port, f"GET / HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())) == 403
    finally:
        for c in stalled:
            c.close()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.1", False), ("0.0.0.0", True)])
def test_the_printed_url_carries_the_token_and_a_public_host_warns(tmp_path: Path, host: str,
                                                                   warned: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "shardfit", "ui", "--runs", str(tmp_path), "--host", host,
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        url = line.split(" on ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and "/?token=" in url
        assert _get(url)[0] == 200 and _get(url.split("?")[0])[0] == 403
    finally:
        proc.terminate()
        stderr = proc.communicate(timeout=60)[1]
    assert ("warning: --host 0.0.0.0 is reachable from other machines" in stderr) == warned, stderr


# ---- the pages in a real browser --------------------------------------------------------------------------------


@needs_browser
def test_plan_calculator_in_a_browser(ui: Served) -> None:
    status, home = _get(ui.url("/"))
    assert status == 200 and "action='/plan'" in home and "no runs yet" in home
    dom = browser_dom(ui.url("/plan", model="meta-llama/Llama-3.1-8B", gpus="8x24GB", method="full", seq="4096",
                             batch="1", grad_ckpt="full"))
    assert "recommended: zero3" in dom and "zero3_offload" in dom and "data:image/png;base64," in dom
    assert "value=\"4096\"" in dom  # the form keeps what was asked
    status, page = _get(ui.url("/plan", model="no/such-model", gpus="8x24GB"))
    assert status == 400 and "no/such-model" in page


# Measures, in the browser, where the plan table's notes end up and whether the page or only the table scrolls.
LAYOUT_PROBE = """<script>
const vw = document.documentElement.clientWidth, box = document.querySelector('.scroll');
const rights = [...document.querySelectorAll('td.notes')].map(td => Math.round(td.getBoundingClientRect().right));
document.body.setAttribute('data-layout', JSON.stringify({vw, rights, page: document.documentElement.scrollWidth,
  box: [box.scrollWidth, box.clientWidth]}));
</script>"""


@needs_browser
def test_plan_table_wraps_or_scrolls_instead_of_cutting_columns(tmp_path: Path) -> None:
    """Item 10 of issue 49: the plan page cut the table's right-hand columns (the notes) off. Now a wide window
    shows every column with the notes wrapped, and a narrow one scrolls the table inside its box while the page
    itself stays as wide as the window."""
    import json

    from shardfit.plan.hardware import parse_gpus
    from shardfit.plan.plan import make_plan
    from shardfit.plan.shapes import resolve_shape
    from shardfit.plan.workload import Workload
    from shardfit.ui.pages import plan_page

    plan = make_plan(resolve_shape("meta-llama/Llama-3.1-8B"), Workload(method="full", seq_len=4096),
                     parse_gpus("8x24GB"))
    page = tmp_path / "plan.html"
    page.write_text(plan_page([], {}, plan, "", "note").replace("</body>", LAYOUT_PROBE + "</body>"))

    def layout(width: int) -> dict:
        cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},900", "--dump-dom",
               page.as_uri()]
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        raw = dom.split('data-layout="', 1)[1].split('"', 1)[0]
        return json.loads(raw.replace("&quot;", '"'))

    wide = layout(1300)
    assert len(wide["rights"]) == 6 and max(wide["rights"]) <= wide["vw"], wide  # every note on screen
    assert wide["box"][0] <= wide["box"][1], wide  # nothing to scroll
    narrow = layout(700)
    assert narrow["page"] <= narrow["vw"], narrow  # the page is not wider than the window: nothing is cut off it
    assert narrow["box"][0] > narrow["box"][1], narrow  # the table scrolls in its box to its notes


@needs_browser
def test_runs_are_listed_and_reported(ui: Served) -> None:
    make_run(ui.runs / "exp1", mem=[[1.0, 1.0], [2.0, 1.2], [3.1, 1.3], [3.1, 1.3]], predicted=2.0)
    assert "/runs/exp1" in _get(ui.url("/"))[1]
    dom = browser_dom(ui.url("/runs/exp1"))
    assert "shardfit report: exp1" in dom and "imbalance: rank 0" in dom and dom.count("data:image/png") == 6
    assert _get(ui.url("/runs/..%2F..%2Fetc"))[0] == 400


ATTACKS = {  # what the other site's page holds besides the form; {ui}: the UI's address, {token}: its token
    "the user's cookie set by an earlier visit": "<img src='{ui}/?token={token}' onerror='go()' onload='go()'>",
    "the token leaked into the form": "<script>document.forms[0].insertAdjacentHTML('beforeend', "
                                      "\"<input name=token value={token}>\"); go()</script>",
}


@needs_browser
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_page_from_another_origin_cannot_launch(ui: Served, tmp_path: Path, attack: str) -> None:
    """The attack of issue 48, replayed: a page on another origin auto-submits a form POST to /launch naming a
    config the UI would launch. Chromium sends it (its answer is the page the browser ends on), and nothing runs."""
    config = write_config(ui.runs / "c.yaml", model="HuggingFaceTB/SmolLM2-135M-Instruct", data=str(DEMO_DATA),
                          output_dir=str(ui.runs / "attacked"))
    site = tmp_path / "site"
    site.mkdir()
    extra = ATTACKS[attack].format(ui=ui.base, token=ui.token)
    (site / "attack.html").write_text(
        "<!DOCTYPE html><html><body>"
        f"<form method='post' action='{ui.base}/launch'><input name='config' value='{config}'>"
        "<input name='nproc' value='1'></form>"
        "<script>function go() { if (!window.sent) { window.sent = 1; document.forms[0].submit(); } }</script>"
        f"{extra}</body></html>")
    other = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=str(site)))
    _serve(other)
    try:
        cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
               "--dump-dom", f"http://127.0.0.1:{other.server_address[1]}/attack.html"]
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    finally:
        other.shutdown()
        other.server_close()
    assert "403 Forbidden" in dom and "may not change anything here" in dom, dom[-2000:]  # the POST arrived
    assert ui.launched == [] and not (ui.runs / "attacked").exists()


@pytest.mark.slow
def test_launch_a_run_and_watch_it(real_ui: Served, tiny_llama: Path, small_data: Path) -> None:
    runs = real_ui.runs
    cfg = write_config(runs / "c.yaml", model=str(tiny_llama), data=str(small_data), method="lora",
                       precision="fp32", max_seq_len=128, micro_batch=4, max_steps=2, log_steps=1, save_steps=100,
                       report_to="none", output_dir=str(runs / "from-ui"))
    jar = http.cookiejar.CookieJar()
    browser_like = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    assert _open(real_ui.url("/"), opener=browser_like)[0] == 200
    bad = urllib.parse.urlencode({"config": str(runs / "nowhere.yaml"), "nproc": "1", "token": real_ui.token})
    status, page, _ = _open(real_ui.base + "/launch", data=bad.encode(), opener=browser_like)
    assert status == 400 and "nowhere.yaml" in page

    form = urllib.parse.urlencode({"config": str(cfg), "nproc": "1", "token": real_ui.token}).encode()
    with browser_like.open(urllib.request.Request(real_ui.base + "/launch", data=form, method="POST"),
                           timeout=60) as r:
        assert r.url.endswith("/jobs/1")  # redirected to the job's page
    deadline = time.time() + 300
    while "job 1: running" in (page := _open(real_ui.base + "/jobs/1", opener=browser_like)[1]) \
            and time.time() < deadline:
        time.sleep(1)
    assert "job 1: finished" in page, page[-3000:]
    assert "/runs/from-ui" in page
    status, report, _ = _open(real_ui.base + "/runs/from-ui", opener=browser_like)
    assert status == 200 and "loss.png" in report and "refresh" not in report


def test_plan_page_plans_what_the_cli_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan page sizes what `shardfit plan --model` sizes for the same flags: shardfit's own kernels (fused
    AdamW, no extra fp32 copy at the step), not a bare Workload's torch defaults (+29.9 GiB for Llama-3-8B full)."""
    import json

    from shardfit.cli.main import main
    from shardfit.ui.server import UI

    form = {"model": "meta-llama/Meta-Llama-3-8B", "gpus": "1x80GB", "method": "full", "seq": "2048", "batch": "1",
            "grad_ckpt": "full"}
    assert main(["plan", "--model", form["model"], "--gpus", form["gpus"], "--method", "full", "--seq", "2048",
                 "--batch", "1", "--grad-ckpt", "full", "--json"]) in (0, 3)  # 3: nothing fits
    cli = json.loads(capsys.readouterr().out)
    assert json.loads(json.dumps(UI(tmp_path).plan_of(form).to_json())) == cli  # as the page sends it
