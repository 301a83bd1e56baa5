"""The traps `doctor` looks for, as pure functions of every rank's facts (no torch: unit-testable from JSON).

Each returns `Finding`s in the `check` format. Severity: `error` breaks or hangs a run, `warning` makes it slow or
fragile, `info` is worth knowing. Rule ids are stable: `diagnose` and the docs refer to them.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Callable

from shardfit.check.findings import Finding
from shardfit.doctor.facts import RankFacts
from shardfit.parallel.ranks import ranks_phrase, span

GIB = 2**30
MIB = 2**20
# NCCL's troubleshooting guide asks containers for --shm-size=1g; below a quarter of that, NCCL's intra-node
# segments (a few MiB per peer and channel) fail to allocate on 8-GPU hosts.
SHM_RECOMMENDED = 1 * GIB
SHM_MINIMUM = 256 * MIB
# Versions whose mismatch breaks collectives or checkpoints (the driver is a warning: newer drivers serve older CUDA).
MUST_MATCH = ("torch", "cuda", "nccl", "python", "shardfit", "transformers", "peft")
# Per-rank variables that legitimately differ between ranks and hosts.
PER_RANK_ENV = {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def hosts_of(facts: list[RankFacts]) -> dict[str, list[RankFacts]]:
    """Ranks grouped by host, hosts in order of their lowest rank."""
    out: dict[str, list[RankFacts]] = {}
    for f in sorted(facts, key=lambda f: f.rank):
        out.setdefault(f.host, []).append(f)
    return out


def uses_gpus(facts: list[RankFacts]) -> bool:
    return any(f.gpus_visible for f in facts)


def is_loopback(addr: str | None) -> bool:
    """A literal loopback address or `localhost` (names are not resolved here)."""
    if not addr:
        return False
    if addr.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def mapping_rules(facts: list[RankFacts]) -> list[Finding]:
    """Rank -> device: two ranks on one GPU, more ranks than GPUs, a mix of GPU and CPU ranks."""
    out = []
    gpu_ranks = [f for f in facts if f.gpus_visible]
    cpu_ranks = [f for f in facts if not f.gpus_visible]
    if gpu_ranks and cpu_ranks:
        out.append(Finding(
            "backend_mismatch", "error", f"{ranks_phrase(f.rank for f in cpu_ranks)}",
            f"{ranks_phrase(f.rank for f in cpu_ranks)} on {', '.join(sorted({f.host for f in cpu_ranks}))} see no "
            f"GPU while {ranks_phrase(f.rank for f in gpu_ranks)} do: they would pick gloo and the others nccl, and "
            "the first collective hangs",
            "give every node working GPUs (check nvidia-smi and CUDA_VISIBLE_DEVICES there), or train on GPU "
            "nodes only"))
    for host, ranks in hosts_of(facts).items():
        gpus = [f for f in ranks if f.gpus_visible]
        if not gpus:
            continue
        visible = max(f.gpus_visible for f in gpus)
        missing = [f.rank for f in gpus if f.gpu is None]
        if missing or len(gpus) > visible:
            out.append(Finding(
                "more_ranks_than_gpus", "error", f"host {host}",
                f"{len(gpus)} ranks on {host} but {visible} GPU(s) visible there: "
                f"{ranks_phrase(missing or [f.rank for f in gpus])} have no GPU of their own",
                f"--nproc {visible} on this host (one rank per GPU), or make more GPUs visible (CUDA_VISIBLE_DEVICES)"))
        by_gpu: dict[str, list[int]] = defaultdict(list)
        for f in gpus:
            if f.gpu is not None:
                by_gpu[f.gpu.uuid or f.gpu.pci].append(f.rank)
        for key, shared in by_gpu.items():
            if len(shared) > 1:
                name = next(f.gpu.name for f in gpus if f.gpu is not None and (f.gpu.uuid or f.gpu.pci) == key)
                out.append(Finding(
                    "gpu_shared_by_ranks", "error", f"host {host}",
                    f"{ranks_phrase(shared)} on {host} use the same GPU ({name} {key}): NCCL refuses two ranks on "
                    "one device ('Duplicate GPU detected') or they fight for its memory",
                    "one rank per GPU: do not set the same CUDA_VISIBLE_DEVICES for every rank, and keep "
                    "--nproc at most the number of GPUs"))
        cvd = {f.env.get("CUDA_VISIBLE_DEVICES") for f in ranks}
        if len(cvd) > 1:
            out.append(Finding(
                "cuda_visible_devices_differ", "warning", f"host {host}",
                f"ranks on {host} see different CUDA_VISIBLE_DEVICES ({', '.join(sorted(map(str, cvd)))}); each "
                "rank takes cuda:LOCAL_RANK of what it sees, so some may land on the same physical GPU",
                "set CUDA_VISIBLE_DEVICES once for the whole node before launching, not per rank"))
    return out


def topology_rules(facts: list[RankFacts], master_addr: str | None) -> list[Finding]:
    """Nodes and hosts: loopback MASTER_ADDR across hosts, two torchrun nodes on one host, uneven nodes."""
    out = []
    hosts = hosts_of(facts)
    if len(hosts) > 1 and is_loopback(master_addr):
        out.append(Finding(
            "master_addr_loopback", "error", "MASTER_ADDR",
            f"MASTER_ADDR is {master_addr} (this machine's loopback) but the ranks run on {len(hosts)} hosts",
            "--master-addr <node 0's address on the network the nodes share> on every node (e.g. from "
            "`hostname -I` on node 0)"))
    nodes_per_host: dict[str, set[int]] = defaultdict(set)
    for f in facts:
        nodes_per_host[f.host].add(f.node)
    for host, nodes in nodes_per_host.items():
        if len(nodes) > 1:
            out.append(Finding(
                "nodes_share_host", "warning", f"host {host}",
                f"torchrun nodes {span(nodes)} all run on {host}: the same launch was started twice on one "
                "machine (fine for a test, wrong on a cluster), or hostnames are not unique",
                "start one launch per machine, with --node-rank 0..K-1 on K different hosts"))
    per_node = {n: sum(1 for f in facts if f.node == n) for n in {f.node for f in facts}}
    if len(set(per_node.values())) > 1:
        out.append(Finding(
            "uneven_ranks_per_node", "warning", "launch",
            "ranks per node differ: " + ", ".join(f"node {n}: {c}" for n, c in sorted(per_node.items())),
            "the same --nproc on every node (torchrun expects it; the strategy plan assumes it)"))
    return out


def hostname_rules(facts: list[RankFacts]) -> list[Finding]:
    """Hosts whose name resolves to loopback only, where shardfit pointed gloo at the reachable interface."""
    out = []
    for host, ranks in hosts_of(facts).items():
        iface = ranks[0].extra.get("gloo_interface_set")
        if iface:
            resolved = ", ".join(ranks[0].extra.get("hostname_resolves_to") or []) or "nothing"
            out.append(Finding(
                "hostname_not_routable", "warning", f"host {host}",
                f"{host} resolves to {resolved} there, so gloo would advertise loopback to the other hosts and they "
                f"could not connect; shardfit set GLOO_SOCKET_IFNAME={iface} (the interface on the route to "
                "MASTER_ADDR) for its ranks",
                f"map {host} to its address on the shared network (DNS or /etc/hosts), or export "
                f"GLOO_SOCKET_IFNAME={iface} for tools launched without shardfit", auto_fixed=True))
    return out


def version_rules(facts: list[RankFacts]) -> list[Finding]:
    """torch / CUDA / NCCL / Python / shardfit / transformers / peft must agree on every rank."""
    out = []
    for name in MUST_MATCH + ("driver",):
        seen: dict[str | None, list[int]] = defaultdict(list)
        for f in facts:
            seen[f.versions.get(name)].append(f.rank)
        if len(seen) < 2:
            continue
        detail = "; ".join(f"{v or 'none'} on {ranks_phrase(r)}" for v, r in sorted(seen.items(), key=lambda x: x[1]))
        severe = name != "driver"
        out.append(Finding(
            "version_mismatch", "error" if severe else "warning", name,
            f"{name} differs between ranks: {detail}" + (
                "; collectives of different builds can hang or exchange garbage" if severe else ""),
            f"install the same {name} on every node (one container image or one lockfile for all nodes)"))
    return out


def shm_rules(facts: list[RankFacts]) -> list[Finding]:
    """/dev/shm: NCCL's intra-node transport lives there when several GPU ranks share a host."""
    out = []
    for host, ranks in hosts_of(facts).items():
        gpu_ranks = [f for f in ranks if f.gpus_visible]
        f = ranks[0]
        if len(gpu_ranks) < 2 or f.shm_total is None:
            continue
        free = f.shm_free if f.shm_free is not None else f.shm_total
        if free < SHM_MINIMUM or f.shm_total < SHM_RECOMMENDED:
            severe = free < SHM_MINIMUM
            out.append(Finding(
                "shm_too_small", "error" if severe else "warning", f"host {host}",
                f"/dev/shm on {host} is {f.shm_total / MIB:.0f} MiB ({free / MIB:.0f} MiB free) for {len(gpu_ranks)} "
                "GPU ranks; NCCL puts its intra-node buffers there and fails ('failed to extend /dev/shm') or falls "
                "back to slower paths",
                "docker run --shm-size=1g --ulimit memlock=-1 (or --ipc=host); on Kubernetes mount an emptyDir with "
                "medium: Memory at /dev/shm"))
    return out


def _select(spec: str, interfaces: list[str], exact_default: bool) -> list[str]:
    """The interfaces an NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME value selects. NCCL: prefixes, `=` for exact
    names, a leading `^` to exclude; Gloo: exact names."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = exact_default or spec.startswith("=")
    items = [s for s in spec.lstrip("=").split(",") if s]

    def match(name: str) -> bool:
        return any(name == i if exact else name.startswith(i) for i in items)

    return [n for n in interfaces if match(n) != exclude]


def nccl_env_rules(facts: list[RankFacts]) -> list[Finding]:
    """Variables that turn off the fast path or point the transport at the wrong interface."""
    out = []
    gpus = uses_gpus(facts)
    multi_host = len(hosts_of(facts)) > 1
    by_rank = {f.rank: f for f in facts}

    def with_value(name: str, pred: Callable[[str], bool]) -> list[int]:
        return [r for r, f in by_rank.items() if name in f.env and pred(f.env[name])]

    def slow(rule_where: str, ranks: list[int], what: str, fix: str, applies: bool) -> None:
        if not ranks:
            return
        sev = "warning" if gpus and applies else "info"
        note = "" if gpus else " (no effect on this CPU job's gloo, but it will slow the same launch on GPUs)"
        out.append(Finding("nccl_env_slow_path", sev, rule_where,
                           f"{rule_where} on {ranks_phrase(ranks)}: {what}{note}", fix))

    on = ("1", "true", "yes")
    consumer = any(f.gpu is not None and "geforce" in f.gpu.name.lower() for f in facts)
    slow("NCCL_P2P_DISABLE", with_value("NCCL_P2P_DISABLE", lambda v: v.lower() in on),
         "GPUs of a host exchange data through host memory instead of NVLink/PCIe peer-to-peer",
         "unset NCCL_P2P_DISABLE (keep it only on GeForce cards whose driver hangs with P2P)", not consumer)
    slow("NCCL_P2P_LEVEL", with_value("NCCL_P2P_LEVEL", lambda v: v.upper() in ("LOC", "0")),
         "peer-to-peer is limited to nothing (LOC)", "unset NCCL_P2P_LEVEL", not consumer)
    slow("NCCL_SHM_DISABLE", with_value("NCCL_SHM_DISABLE", lambda v: v.lower() in on),
         "the shared-memory transport between GPUs of a host is off", "unset NCCL_SHM_DISABLE", True)
    has_ib = any(f.infiniband for f in facts)
    slow("NCCL_IB_DISABLE", with_value("NCCL_IB_DISABLE", lambda v: v.lower() in on),
         "InfiniBand/RoCE is off: traffic between nodes goes over TCP sockets" + (
             f" although {', '.join(sorted({d for f in facts for d in f.infiniband}))} exist" if has_ib else ""),
         "unset NCCL_IB_DISABLE", multi_host and has_ib)
    slow("NCCL_NET", with_value("NCCL_NET", lambda v: v.lower() == "socket"),
         "NCCL is forced onto TCP sockets between nodes", "unset NCCL_NET", multi_host and has_ib)
    blocking = with_value("CUDA_LAUNCH_BLOCKING", lambda v: v.lower() in on)
    if blocking:
        out.append(Finding("cuda_launch_blocking", "warning" if gpus else "info", "CUDA_LAUNCH_BLOCKING",
                           f"CUDA_LAUNCH_BLOCKING=1 on {ranks_phrase(blocking)} serialises every kernel (a debugging "
                           "switch): steps run several times slower", "unset CUDA_LAUNCH_BLOCKING"))
    for name, exact in (("NCCL_SOCKET_IFNAME", False), ("GLOO_SOCKET_IFNAME", True)):
        for f in facts:
            spec = f.env.get(name)
            if not spec or not f.interfaces:
                continue
            chosen = _select(spec, f.interfaces, exact)
            if not chosen:
                out.append(Finding(
                    "socket_ifname_missing", "error", f"{name} on host {f.host}",
                    f"{name}={spec} selects no interface on {f.host} (it has {', '.join(f.interfaces)}): the "
                    "process group cannot open its sockets",
                    f"set {name} to the interface of the network the nodes share (see `ip -br addr` on each node)"))
                break
            if multi_host and all(c.startswith("lo") for c in chosen):
                out.append(Finding(
                    "socket_ifname_loopback", "error", f"{name} on host {f.host}",
                    f"{name}={spec} selects only loopback on {f.host}, but the ranks span several hosts",
                    f"set {name} to the interface of the network the nodes share (see `ip -br addr`)"))
                break
    return out


def memlock_rules(facts: list[RankFacts]) -> list[Finding]:
    """InfiniBand/RoCE registers (pins) NCCL's buffers: a small memlock limit makes that fail between nodes."""
    if not uses_gpus(facts) or len(hosts_of(facts)) < 2:
        return []
    low = [f for f in facts if f.infiniband and f.memlock is not None and 0 <= f.memlock < 64 * MIB]
    if not low:
        return []
    return [Finding("memlock_limited", "warning", "ulimit -l",
                    f"the locked-memory limit is {low[0].memlock // 1024} KiB on "
                    f"{', '.join(sorted({f.host for f in low}))}; NCCL over InfiniBand needs to pin its buffers",
                    "ulimit -l unlimited (docker: --ulimit memlock=-1; SLURM: PropagateResourceLimits)")]


def env_consistency_rules(facts: list[RankFacts]) -> list[Finding]:
    """NCCL/Gloo variables set on some ranks only (typically exported on one node's shell)."""
    names = {k for f in facts for k in f.env if k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_"))} - PER_RANK_ENV
    out = []
    for name in sorted(names):
        values: dict[str | None, list[int]] = defaultdict(list)
        for f in facts:
            values[f.env.get(name)].append(f.rank)
        if len(values) > 1:
            detail = "; ".join(f"{'unset' if v is None else v} on {ranks_phrase(r)}"
                               for v, r in sorted(values.items(), key=lambda x: x[1]))
            out.append(Finding("env_differs_between_ranks", "warning", name,
                               f"{name} differs between ranks: {detail}; NCCL requires the same setting everywhere "
                               "or it may choose incompatible transports",
                               f"export the same {name} on every node (in the job script, not one node's shell)"))
    return out


def cpu_rules(facts: list[RankFacts]) -> list[Finding]:
    """CPU ranks whose threads exceed the host's cores: every step waits for the slowest, oversubscribed rank."""
    out = []
    for host, ranks in hosts_of(facts).items():
        if any(f.gpus_visible for f in ranks):
            continue
        threads = sum(f.threads for f in ranks)
        cpus = ranks[0].cpus
        if len(ranks) > 1 and threads > cpus:
            out.append(Finding(
                "cpu_oversubscribed", "warning", f"host {host}",
                f"{len(ranks)} ranks x {ranks[0].threads} threads on {host}'s {cpus} cores: the ranks steal cores "
                "from each other and every collective waits for the slowest",
                f"OMP_NUM_THREADS={max(1, cpus // len(ranks))}" if ranks[0].threads > 1 else
                f"at most {cpus} CPU ranks on {host} (--nproc {cpus})"))
    return out


def output_dir_rules(facts: list[RankFacts], output_dir: str | None) -> list[Finding]:
    """Every rank must see what rank 0 writes in output_dir (sharded checkpoints are written by all ranks)."""
    if output_dir is None:
        if len(hosts_of(facts)) > 1:
            return [Finding("output_dir_unchecked", "info", "output_dir",
                            "no output_dir given, so doctor did not check that the nodes share it",
                            "shardfit doctor CONFIG.yaml (or --output-dir DIR) with the run's output_dir")]
        return []
    blind = [f for f in facts if f.sees_output_dir is False]
    if not blind:
        return []
    hosts = sorted({f.host for f in blind})
    return [Finding("output_dir_not_shared", "error", "output_dir",
                    f"output_dir {output_dir} is not shared: {ranks_phrase(f.rank for f in blind)} on "
                    f"{', '.join(hosts)} cannot see the file rank 0 wrote there; checkpoints would be incomplete",
                    "put output_dir on a filesystem every node mounts (NFS, Lustre, a shared volume) at the same path")]


def data_rules(facts: list[RankFacts]) -> list[Finding]:
    """The config's data files as every rank sees them: missing on a node, or a different file there (the ranks
    would count different steps and the first to finish would leave the others waiting in a collective)."""
    out = []
    paths = sorted({p for f in facts for p in f.extra.get("data_files", {})})
    for path in paths:
        sizes: dict[int | None, list[int]] = defaultdict(list)
        for f in facts:
            sizes[f.extra.get("data_files", {}).get(path)].append(f.rank)
        if len(sizes) < 2 and None not in sizes:
            continue
        hosts = {f.rank: f.host for f in facts}
        detail = "; ".join(f"{'missing' if size is None else f'{size} bytes'} on {ranks_phrase(rs)} "
                           f"({', '.join(sorted({hosts[r] for r in rs}))})"
                           for size, rs in sorted(sizes.items(), key=lambda x: x[1]))
        out.append(Finding("data_differs_between_nodes", "error", path,
                           f"the data file {path} is not the same on every rank: {detail}",
                           "put the data on a filesystem every node mounts, or copy the same file to the same "
                           "path on every node"))
    return out


def rank_rules(facts: list[RankFacts], output_dir: str | None) -> list[Finding]:
    """Every rule over the gathered facts, in the order the report shows them."""
    master = facts[0].env.get("MASTER_ADDR") if facts else None
    return (mapping_rules(facts) + topology_rules(facts, master) + hostname_rules(facts) + version_rules(facts)
            + shm_rules(facts) + nccl_env_rules(facts) + memlock_rules(facts) + env_consistency_rules(facts)
            + cpu_rules(facts) + output_dir_rules(facts, output_dir) + data_rules(facts))
