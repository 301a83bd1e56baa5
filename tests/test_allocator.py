"""The malloc a CPU training process runs with: discovery, the user's choice, the re-executed environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.parallel.allocator import (
    CHOICE_ENV,
    PRELOADED_ENV,
    Allocator,
    active,
    choose,
    command_of,
    find,
    library_dirs,
    preload_environment,
)
from tests.helpers import run_cli


def _libs(root: Path, *names: str) -> list[Path]:
    """Two library folders, the names installed in the second (discovery only looks at files)."""
    first, second = root / "env-lib", root / "usr-lib"
    first.mkdir(parents=True), second.mkdir(parents=True)
    for n in names:
        (second / n).write_bytes(b"")
    return [first, second]


def test_auto_prefers_tcmalloc_then_jemalloc_then_the_c_library(tmp_path: Path) -> None:
    both = _libs(tmp_path / "a", "libjemalloc.so.2", "libtcmalloc_minimal.so.4")
    assert choose({}, both) == Allocator("tcmalloc", str(both[1] / "libtcmalloc_minimal.so.4"))
    only_je = _libs(tmp_path / "b", "libjemalloc.so.2")
    assert choose({CHOICE_ENV: "auto"}, only_je).name == "jemalloc"
    assert choose({}, _libs(tmp_path / "c")) is None


def test_gpu_hosts_the_users_preload_and_a_decided_process_keep_what_they_have(tmp_path: Path) -> None:
    dirs = _libs(tmp_path, "libtcmalloc_minimal.so.4")
    assert choose({}, dirs, gpu=True) is None
    assert choose({"LD_PRELOAD": "/opt/libmimalloc.so"}, dirs) is None
    assert choose({PRELOADED_ENV: "tcmalloc:/x"}, dirs) is None  # never a second re-exec
    assert choose({CHOICE_ENV: "system"}, dirs) is None
    assert choose({CHOICE_ENV: "tcmalloc"}, dirs, gpu=True).name == "tcmalloc"  # asked by name: even on a GPU host


def test_the_install_hint_shows_only_where_tcmalloc_would_change_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardfit.parallel import allocator

    monkeypatch.setattr(allocator, "gpu_host", lambda: False)
    assert allocator.install_would_help({}, "system", "cpu")
    assert allocator.install_would_help({CHOICE_ENV: " "}, "system", "cpu")  # blank is auto, as choose reads it
    assert not allocator.install_would_help({}, "tcmalloc", "cpu")  # already has it
    assert not allocator.install_would_help({CHOICE_ENV: "system"}, "system", "cpu")  # the user's choice
    assert not allocator.install_would_help({}, "system", "cuda")
    monkeypatch.setattr(allocator, "gpu_host", lambda: True)  # auto keeps glibc there whatever is installed
    assert not allocator.install_would_help({}, "system", "cpu")


def test_a_named_allocator_that_is_missing_or_unknown_is_a_user_error(tmp_path: Path) -> None:
    dirs = _libs(tmp_path, "libtcmalloc_minimal.so.4")
    with pytest.raises(UserError, match=r"SHARDFIT_ALLOCATOR=jemalloc: no jemalloc library .*libjemalloc2"):
        choose({CHOICE_ENV: "jemalloc"}, dirs)
    with pytest.raises(UserError, match="not an allocator. Use auto, system, tcmalloc, jemalloc"):
        choose({CHOICE_ENV: "tcmaloc"}, dirs)
    with pytest.raises(UserError, match="no such file"):
        choose({CHOICE_ENV: str(tmp_path / "libmimalloc.so")}, dirs)
    (tmp_path / "libmimalloc.so").write_bytes(b"")
    assert choose({CHOICE_ENV: str(tmp_path / "libmimalloc.so")}, dirs) == \
        Allocator("libmimalloc.so", str(tmp_path / "libmimalloc.so"))


def test_the_preloaded_environment_keeps_the_users_own() -> None:
    a = Allocator("tcmalloc", "/usr/lib/libtcmalloc_minimal.so.4")
    env = preload_environment({"LD_PRELOAD": "/opt/libfoo.so", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, a)
    assert env["LD_PRELOAD"] == f"{a.path}{os.pathsep}/opt/libfoo.so"
    assert env[PRELOADED_ENV] == f"tcmalloc:{a.path}" and env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128" and env["LRU_CACHE_CAPACITY"] == "16"
    assert preload_environment({"LRU_CACHE_CAPACITY": "1024"}, a)["LRU_CACHE_CAPACITY"] == "1024"
    assert preload_environment({}, a)["LD_PRELOAD"] == a.path


def test_only_train_is_re_executed_and_the_run_reports_what_is_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    assert command_of(["--debug", "train", "c.yaml"]) == "train" and command_of(["plan", "c.yaml"]) == "plan"
    monkeypatch.setenv(PRELOADED_ENV, "tcmalloc:/usr/lib/libtcmalloc_minimal.so.4")
    assert active("7f00-7f01 r-xp 0 08:01 12 /usr/lib/libtcmalloc_minimal.so.4.5.10\n") == "tcmalloc"
    assert active("7f00-7f01 r-xp 0 08:01 12 /usr/lib/libc.so.6\n") == "system"  # the preload failed to load
    monkeypatch.delenv(PRELOADED_ENV)
    assert active() == "system"


def test_the_search_covers_the_environment_and_the_system() -> None:
    dirs = [str(d) for d in library_dirs()]
    assert dirs[0].endswith("/lib") and "/usr/lib" in dirs and "/usr/lib64" in dirs
    assert find("tcmalloc", [Path("/nonexistent")]) is None


def test_a_bad_choice_stops_train_before_anything_loads(tmp_path: Path) -> None:
    r = run_cli("train", str(tmp_path / "missing.yaml"), env={CHOICE_ENV: "fastest"})
    assert r.returncode == 2 and "SHARDFIT_ALLOCATOR=fastest: not an allocator" in r.stderr
    assert "Traceback" not in r.stderr


_HOLD_AND_RELEASE = """
import json
from shardfit.parallel.allocator import release_free_memory

def rss_mib():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) / 1024

before = rss_mib()
held = [bytearray(b'x') * 100_000 for _ in range(2000)]  # 200 MB in blocks below glibc's mmap threshold
peak = rss_mib()
del held
freed = rss_mib()
name = release_free_memory()
print(json.dumps({"before": before, "peak": peak, "freed": freed, "after": rss_mib(), "name": name}))
"""


@pytest.mark.parametrize("name", ["tcmalloc", "jemalloc", "system"])
def test_release_hands_freed_pages_back_to_the_system(name: str) -> None:
    """After the release the resident set is what is alive again, whichever allocator serves the process; without
    it tcmalloc and jemalloc keep the freed pages."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if name != "system":
        lib = find(name, library_dirs())
        if lib is None:
            pytest.skip(f"{name} is not installed here")
        env["LD_PRELOAD"] = lib.path
    out = subprocess.run([sys.executable, "-c", _HOLD_AND_RELEASE], env=env, capture_output=True, text=True,
                         check=True)
    r = json.loads(out.stdout)
    assert r["name"] == ("glibc" if name == "system" else name)
    assert r["peak"] - r["before"] > 150
    assert r["after"] < r["before"] + 40, r


_NEW_MATMUL_SHAPES = """
import ctypes, json, torch
lib = ctypes.CDLL(None)

def live_mib():
    v = ctypes.c_size_t()
    lib.MallocExtension_GetNumericProperty(b"generic.current_allocated_bytes", ctypes.byref(v))
    return v.value / 2**20

w = torch.randn(256, 256, dtype=torch.bfloat16)
torch.randn(16, 256, dtype=torch.bfloat16) @ w  # the first matmul's one-time setup, outside the count
before = live_mib()
for rows in range(16, 16 * 201, 16):  # a new row count every time, as packed rows of a new width bring
    x = torch.randn(rows, 256, dtype=torch.bfloat16, requires_grad=True)
    (x @ w).sum().backward()
print(json.dumps({"growth": live_mib() - before}))
"""


def test_the_matmul_caches_stop_growing_with_new_shapes() -> None:
    """200 bf16 matmul shapes, forward and backward: the live heap grows by what the kernel caches keep. The
    re-executed process's LRU_CACHE_CAPACITY bounds PyTorch's cache of whole oneDNN computations, which by
    default keeps 1024 of them."""
    import json
    import subprocess
    import sys

    lib = find("tcmalloc", library_dirs())
    if lib is None:
        pytest.skip("the live heap is read from tcmalloc, which is not installed here")
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LRU_CACHE_CAPACITY")}
    growth = {}
    for capacity in (None, "1024"):
        env = preload_environment(base, Allocator("tcmalloc", lib.path))
        env["OMP_NUM_THREADS"] = "1"
        if capacity:
            env["LRU_CACHE_CAPACITY"] = capacity
        out = subprocess.run([sys.executable, "-c", _NEW_MATMUL_SHAPES], env=env, capture_output=True, text=True,
                             check=True)
        growth[capacity] = json.loads(out.stdout)["growth"]
    if growth["1024"] < 30:
        pytest.skip(f"bf16 matmuls here do not go through oneDNN's cached computations ({growth})")
    assert growth[None] < 0.5 * growth["1024"], growth
