"""Who may use the UI, and how much of the server one request may take.

The UI starts training processes, so any web page the user happens to open must not be able to drive it. The
protections follow Jupyter's and TensorBoard's:

- a random token, printed in the URL at start; a visit with it sets an HttpOnly, SameSite=Strict cookie so the
  page's own links work; a request with neither gets 403;
- the Host header must name this server (a loopback name or the bound host, and its port): a DNS-rebinding page
  reaches the server under its own domain name, which is refused;
- a request that changes something (POST) must carry the token itself (form field or header: SameSite keeps the
  cookie from other sites' forms, but a page served by another local server on 127.0.0.1 is the same site) and,
  when the browser says where it comes from (Origin), come from this server.

Limits: a body over MAX_BODY is refused from its Content-Length (413) before a byte of it is read, a malformed
length or a chunked body is 400, and a request that stalls is answered 408 or dropped.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from email.message import Message
from http import HTTPStatus
from typing import BinaryIO
from urllib.parse import urlsplit

MAX_BODY = 1 << 20  # a launch form is a few hundred bytes; 1 MiB leaves room and bounds memory per request
READ_TIMEOUT_S = 10.0  # one silent socket read longer than this ends the request
BODY_DEADLINE_S = 30.0  # a whole body must arrive within this, however it is trickled
TOKEN_FIELD = "token"  # the form field (and query parameter) carrying the token
TOKEN_HEADER = "X-Shardfit-Token"  # the same for scripts that POST without a form
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_LENGTH = re.compile(r"[0-9]{1,15}")  # int() would also take "+5", " 5" and "1_0"


class Refused(Exception):
    """A request answered with `status` and a one-line reason, before it reaches a page."""

    def __init__(self, status: HTTPStatus, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def new_token() -> str:
    """An unguessable token (256 bits), URL-safe so it travels in a query string."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """True for names and addresses that only this machine can reach."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _split_host_port(value: str) -> tuple[str, int | None] | None:
    """`name:port`, `[v6]:port` or a bare name as (lower-cased name without brackets, port); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, sep, port_text_ = value.partition(":")
        port_text = port_text_ if sep else None
    if port_text is None:
        return name, None
    if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        return None
    return name, int(port_text)


@dataclass(frozen=True)
class Guard:
    """The checks of one running server: its token and the address it is bound to."""

    token: str
    host: str
    port: int
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        bound = self.host.strip("[]").lower()
        names = set(LOOPBACK_NAMES) | ({bound} if bound not in WILDCARD_HOSTS else set())
        if bound in WILDCARD_HOSTS:
            # Bound to every interface: other machines reach it by this machine's name (IP literals are
            # accepted below; DNS rebinding needs a name the attacker controls, never a literal address).
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        object.__setattr__(self, "names", frozenset(names))

    @property
    def cookie_name(self) -> str:
        # Cookies ignore the port: two UIs on one machine must not overwrite each other's.
        return f"shardfit-ui-{self.port}"

    def set_cookie(self) -> str:
        """The Set-Cookie value: scripts cannot read it, and no other site's page sends it along."""
        return f"{self.cookie_name}={self.token}; HttpOnly; SameSite=Strict; Path=/"

    def _names_this_server(self, value: str, default_port: int) -> bool:
        parsed = _split_host_port(value)
        if parsed is None:
            return False
        name, port = parsed
        if (port if port is not None else default_port) != self.port:
            return False
        wildcard = self.host.strip("[]").lower() in WILDCARD_HOSTS
        return name in self.names or (wildcard and _is_ip(name))

    def check_host(self, host_header: str | None) -> None:
        """403 unless the Host header names this server (blocks DNS rebinding)."""
        if not host_header or not self._names_this_server(host_header, 80):
            raise Refused(HTTPStatus.FORBIDDEN, f"Host {host_header!r} is not this server's address; open the URL "
                                                "`shardfit ui` printed.")

    def check_origin(self, origin: str | None) -> None:
        """403 when the browser says the request comes from a page of another origin (or an opaque one)."""
        if origin is None:
            return  # not a browser (curl, scripts): the token in the body is what they must show
        parts = urlsplit(origin)
        if parts.scheme != "http" or not parts.netloc or not self._names_this_server(parts.netloc, 80):
            raise Refused(HTTPStatus.FORBIDDEN, f"a page from {origin} may not change anything here.")

    def token_ok(self, candidate: str | None) -> bool:
        """Constant-time comparison, so response timing does not reveal how much of a guess was right."""
        return candidate is not None and hmac.compare_digest(candidate.encode(), self.token.encode())

    def cookie_token(self, cookie_header: str | None) -> str | None:
        """This server's token from a Cookie header, if it carries one."""
        for part in (cookie_header or "").split(";"):
            name, sep, value = part.strip().partition("=")
            if sep and name == self.cookie_name:
                return value.strip()
        return None


def content_length(headers: Message) -> int:
    """The declared body size of a request (0 when none is declared): 400 for a chunked body or a malformed,
    repeated or negative length; 413 when over MAX_BODY. Checked before reading, so a huge declared body never
    costs memory."""
    if headers.get_all("Transfer-Encoding"):
        raise Refused(HTTPStatus.BAD_REQUEST, "chunked or encoded bodies are not accepted; send Content-Length.")
    values = headers.get_all("Content-Length") or []
    if not values:
        return 0
    if len(set(values)) > 1 or not _LENGTH.fullmatch(values[0].strip()):
        raise Refused(HTTPStatus.BAD_REQUEST, f"bad Content-Length {', '.join(values)!r}.")
    length = int(values[0])
    if length > MAX_BODY:
        raise Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length} bytes; the most is {MAX_BODY}.")
    return length


def read_body(rfile: BinaryIO, length: int, deadline_s: float = BODY_DEADLINE_S) -> bytes:
    """Exactly `length` bytes, read piecewise so a client trickling one byte at a time still meets a deadline:
    408 when it passes or one read times out, 400 when the client stops short."""
    end = time.monotonic() + deadline_s
    chunks: list[bytes] = []
    got = 0
    while got < length:
        if time.monotonic() > end:
            raise Refused(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within {deadline_s:g} s.")
        try:
            chunk = rfile.read1(min(length - got, 1 << 16))  # type: ignore[attr-defined]
        except TimeoutError:
            raise Refused(HTTPStatus.REQUEST_TIMEOUT, "the body stopped arriving.") from None
        if not chunk:
            raise Refused(HTTPStatus.BAD_REQUEST, f"the body ended after {got} of {length} bytes.")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
