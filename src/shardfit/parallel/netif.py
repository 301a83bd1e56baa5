"""The network interface gloo should advertise when the ranks span hosts.

Gloo announces the address its host's name resolves to. Where that name resolves to loopback or to nothing (a
container or a fresh VM: `127.0.1.1 myhost` in /etc/hosts), it falls back to 127.0.0.1 and the ranks of the other
hosts fail with "Connection refused, remote=[127.0.0.1]" after a long timeout. The interface on the route to
MASTER_ADDR is the one the other nodes can reach: shardfit sets GLOO_SOCKET_IFNAME to it for its own ranks.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

import psutil


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def hostname_addresses(name: str | None = None) -> list[str]:
    """What this host's name (or `name`) resolves to here; [] when it does not resolve."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(name or socket.gethostname(), None)})
    except OSError:
        return []


def route_address(host: str | None, port: int) -> str | None:
    """The local address the kernel would use to reach `host` (a UDP connect sends nothing)."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The local interface that holds `address`."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def gloo_interface_fix(environ: Mapping[str, str]) -> str | None:
    """The interface to put in GLOO_SOCKET_IFNAME for a rank of a multi-host launch whose host name does not
    resolve to a routable address; None when nothing needs fixing (set already, one host, or a good name)."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return None
    world = int(environ.get("WORLD_SIZE", "1"))
    local = int(environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world <= local:
        return None  # every rank on this host: loopback is the right address
    if any(not _loopback(a) for a in hostname_addresses()):
        return None
    src = route_address(environ.get("MASTER_ADDR"), int(environ.get("MASTER_PORT", "29500") or 29500))
    if src is None or _loopback(src):
        return None
    return interface_of(src)
