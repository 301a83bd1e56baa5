"""Two "hosts" on this machine: two network namespaces joined by a veth pair, each with its own address and its
own host name (a UTS namespace per command). Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; callers
skip when `TwoHosts.unavailable()` gives a reason. Only the namespaces and addresses made here are touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Namespaces `<tag>a` and `<tag>b` with 10.<x>.<y>.1 and .2 on a veth pair (x, y from the pid)."""

    def __init__(self, tag: str | None = None):
        pid = os.getpid()
        self.tag = tag or f"sf{pid % 100000}"
        self.names = (f"{self.tag}a", f"{self.tag}b")
        self.links = (f"v{self.tag}a", f"v{self.tag}b")  # at most 15 characters
        self.addrs = (f"10.{200 + pid % 50}.{pid // 50 % 250}.1", f"10.{200 + pid % 50}.{pid // 50 % 250}.2")
        self.hostnames = ("node0", "node1")

    @staticmethod
    def unavailable() -> str | None:
        """Why two namespaces cannot be made here, or None."""
        if sys.platform != "linux":
            return "network namespaces are Linux only"
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            return "needs iproute2 (ip) and util-linux (unshare)"
        if os.geteuid() != 0:
            return "needs root to create network namespaces"
        probe = f"sfprobe{os.getpid() % 100000}"
        made = _ip("netns", "add", probe)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        _ip("netns", "del", probe)
        return None

    def __enter__(self) -> TwoHosts:
        a, b = self.names
        try:
            for step in (["netns", "add", a], ["netns", "add", b],
                         ["link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]],
                         ["link", "set", self.links[0], "netns", a], ["link", "set", self.links[1], "netns", b],
                         ["-n", a, "addr", "add", f"{self.addrs[0]}/24", "dev", self.links[0]],
                         ["-n", b, "addr", "add", f"{self.addrs[1]}/24", "dev", self.links[1]],
                         ["-n", a, "link", "set", "lo", "up"], ["-n", b, "link", "set", "lo", "up"],
                         ["-n", a, "link", "set", self.links[0], "up"], ["-n", b, "link", "set", self.links[1], "up"]):
                r = _ip(*step)
                if r.returncode != 0:
                    raise RuntimeError(f"ip {' '.join(step)}: {r.stderr.strip()}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.names:  # deleting a namespace deletes its end of the veth pair, and so the pair
            _ip("netns", "del", ns)

    def popen(self, host: int, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
        """Run `argv` on host 0 or 1: inside its network namespace, with its own host name."""
        cmd = ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "sh", "-c",
               'hostname "$0" && exec "$@"', self.hostnames[host], *argv]
        return subprocess.Popen(cmd, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
