"""A cluster of hosts on one machine: each host a Linux network namespace on a bridge.

Host `role` is the namespace `mintc-<tag>-<role>`, wired by a veth pair: the root side
`mc<tag><i>` is a port of the bridge `mcb<tag>` (STP off, no forward delay), the other side is
`eth0` inside (issue 37 sets GLOO_SOCKET_IFNAME=eth0), on a free private 10.a.b.0/24; the bridge
takes .1, so probes from the test process reach every host. Every namespace knows every MAC
address in advance (permanent neighbour entries): a cut host never answers ARP, so a connect to
it times out as across a real partition instead of failing fast with "no route to host".

`cut(role)` sets the root side down and `rejoin(role)` up: packets vanish, nothing sends a
RST. `run(role, ...)` starts a process inside a host through `ip netns exec`, which execs in
place: the pid and process group are the child's own, and stopping its group stops it.

Nothing outlives the cluster: `close()` (run by the context manager, in `finally`) stops every
process, kills what is left in each namespace, deletes the namespaces (their veths go with
them) and the bridge. A record /run/mint-cluster/<tag>.json, written before anything is made,
names the owner and what it made, so `sweep()` removes clusters whose owner died (a SIGKILLed
pytest). `leftovers()` says what of a cluster is still there.
"""

import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mint_core.errors import ServiceError
from processes.managed import ManagedProcess, responds_ok, stop_all, wait_healthy
from tests.process_leaks import CLUSTER_RECORDS as RECORDS

PREFIX = "mintc-"
IP_TIMEOUT_S = 10.0
MADE: list["Cluster"] = []
"""Every cluster this process made: the session-end check looks for what is left of them."""
CLEAN_VARIABLES = ("MINT_", "PREFECT_", "MLFLOW_", "AWS_", "GLOO_", "MASTER_")
"""Prefixes of variables a host does not inherit from the test process: each host's settings
are its own (the integration lane writes MINT_* into the test process's environment)."""
ROOT = Path(__file__).resolve().parents[2]
"""The repository: hosts run `python -m tests.cluster.relay` and the like from here."""


@dataclass(frozen=True)
class Host:
    """One host of the cluster."""

    role: str
    namespace: str
    link: str
    """The root side of its veth pair: what a cut sets down."""
    address: str
    """Its address on eth0 (MASTER_ADDR for issue 37, the host part of its URLs)."""
    mac: str


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (a probe namespace is made
    and deleted)."""
    if not Path("/proc/self/ns/net").exists():
        return "no Linux network namespaces on this system"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    """Hosts named by role, made on entry and removed on exit (see the module docstring)."""

    def __init__(self, roles: Sequence[str], state_dir: Path, tag: str | None = None) -> None:
        if len(set(roles)) != len(roles) or not roles:
            raise ValueError(f"roles must be distinct and not empty, got {list(roles)}")
        self.tag = tag or secrets.token_hex(3)
        self.state_dir = state_dir
        self.bridge = f"mcb{self.tag}"
        self.roles = tuple(roles)
        self.hosts: dict[str, Host] = {}
        self.processes: list[ManagedProcess] = []
        self._subnet: ipaddress.IPv4Network | None = None

    @property
    def namespaces(self) -> list[str]:
        return [f"{PREFIX}{self.tag}-{role}" for role in self.roles]

    @property
    def links(self) -> list[str]:
        return [self.bridge, *(f"mc{self.tag}{i}" for i in range(len(self.roles)))]

    @property
    def gateway_address(self) -> str:
        """The bridge's address: where the test process's packets come from."""
        assert self._subnet is not None
        return str(self._subnet.network_address + 1)

    def __enter__(self) -> "Cluster":
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        sweep()
        MADE.append(self)
        self._subnet = free_subnet()
        self._write_record()
        net = self._subnet
        _ip("link", "add", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("addr", "add", f"{self.gateway_address}/{net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (role, namespace, link) in enumerate(
            zip(self.roles, self.namespaces, self.links[1:], strict=True)
        ):
            address = str(net.network_address + 2 + i)
            octets = net.network_address.packed
            mac = f"02:6d:{octets[1]:02x}:{octets[2]:02x}:00:{i + 2:02x}"
            self.hosts[role] = Host(role, namespace, link, address, mac)
            _ip("netns", "add", namespace)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "address", mac,
                "netns", namespace)  # fmt: skip
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
        bridge_mac = Path(f"/sys/class/net/{self.bridge}/address").read_text().strip()
        everyone = [(h.address, h.mac) for h in self.hosts.values()]
        for host in self.hosts.values():
            others = [(a, m) for a, m in everyone if a != host.address]
            _neighbours(host.namespace, "eth0", [(self.gateway_address, bridge_mac), *others])
        _neighbours(None, self.bridge, everyone)

    def host(self, role: str) -> Host:
        try:
            return self.hosts[role]
        except KeyError:
            known = sorted(self.hosts)
            raise KeyError(f"no host {role!r} in the cluster; its hosts: {known}") from None

    def cut(self, role: str) -> None:
        """Cut `role` off: its link goes down, its packets vanish (no RST, no ICMP)."""
        _ip("link", "set", self.host(role).link, "down")

    def rejoin(self, role: str) -> None:
        _ip("link", "set", self.host(role).link, "up")

    def run(
        self,
        role: str,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        url: str = "",
        health: str | Callable[[], bool] | None = None,
        timeout_s: float = 120.0,
        grace_s: float = 10.0,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """Start `argv` inside host `role` as `name` and return it, once healthy when `health`
        is given (`url + health` answers 200, or `health()` is true). Its environment is the
        test process's without MinT, Prefect, MLflow and AWS settings, plus `env`. Its log is
        <state_dir>/<role>/<name>.log; `close()` stops it."""
        host = self.host(role)
        log_path = self.state_dir / role / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=host_environment(env),
                cwd=cwd or ROOT,
                start_new_session=True,
            )
        service = ManagedProcess(f"{name}@{role}", process, url, log_path, grace_s)
        self.processes.append(service)
        if health is not None:
            healthy = health if callable(health) else lambda: responds_ok(url + health)
            wait_healthy(service, healthy, timeout_s)
        return service

    def call(
        self, role: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run `argv` inside host `role` to its end (from the repository, environment as for
        `run`) and return what it printed."""
        return subprocess.run(
            ["ip", "netns", "exec", self.host(role).namespace, *argv],
            env=host_environment(env), cwd=ROOT, capture_output=True, text=True,
            timeout=timeout_s, check=False,
        )  # fmt: skip

    def pids(self, role: str) -> list[int]:
        """Every process inside host `role`."""
        found = _ip("netns", "pids", self.host(role).namespace, check=False)
        return [int(pid) for pid in found.stdout.split()]

    def kill_host(self, role: str) -> list[int]:
        """SIGKILL every process inside host `role` (a host that dies: no process gets to say
        goodbye); returns their pids. Its namespace and link stay: `run` starts it again."""
        killed = self.pids(role)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def close(self) -> None:
        """Stop everything and remove every namespace and link; then check nothing is left.
        ServiceError if something is."""
        try:
            stop_all(self.processes)
        finally:
            remove(self.tag, self.namespaces, self.links)
        left = leftovers(self.namespaces, self.links)
        if left:
            raise ServiceError(f"cluster {self.tag}: still there after teardown: {left}")
        (RECORDS / f"{self.tag}.json").unlink(missing_ok=True)

    def _write_record(self) -> None:
        RECORDS.mkdir(parents=True, exist_ok=True)
        record = {
            "owner": os.getpid(),
            "owner_start": _start_time(os.getpid()),
            "namespaces": self.namespaces,
            "links": self.links,
        }
        (RECORDS / f"{self.tag}.json").write_text(json.dumps(record))


def host_environment(env: Mapping[str, str] | None) -> dict[str, str]:
    """The test process's environment without the prefixes of CLEAN_VARIABLES, plus `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_VARIABLES)}
    return {**base, **(env or {})}


def listens(address: str, port: int) -> bool:
    """Whether something accepts TCP connections at `address`:`port` right now (a health
    check for what speaks no HTTP of its own, like the relay)."""
    try:
        socket.create_connection((address, port), timeout=1).close()
    except OSError:
        return False
    return True


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and all its descendants, whatever session or group they are in (a killed
    host: its Prefect worker and the flow runs it started). Returns the pids killed."""
    killed: list[int] = []
    for _ in range(3):  # a process forking while we look gets caught the next time round
        tree = [p for p in _descendants(pid) if p not in killed]
        if not tree:
            break
        for each in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGKILL)
            killed.append(each)
    return killed


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid] if Path(f"/proc/{pid}").exists() else []
    while todo:
        each = todo.pop()
        found.append(each)
        todo.extend(children.get(each, []))
    return found


def free_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A 10.a.b.0/24 that overlaps no address or route of this machine's root namespace."""
    taken = [*_networks(_ip("-4", "-o", "addr").stdout, field=3)]
    taken += [*_networks(_ip("-4", "route", "show", "table", "all").stdout, field=0)]
    rng = rng or random.Random()
    for _ in range(1000):
        candidate = ipaddress.IPv4Network(f"10.{rng.randrange(1, 255)}.{rng.randrange(256)}.0/24")
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise ServiceError(f"no free 10.x.y.0/24 here: addresses and routes cover {taken}")


def _networks(listing: str, field: int) -> Iterable[ipaddress.IPv4Network]:
    for line in listing.splitlines():
        words = line.split()
        if words and words[0] in ("broadcast", "local", "unreachable", "blackhole", "prohibit"):
            words = words[1:]  # route types before the destination
        if len(words) <= field or words[field] == "default":
            continue
        with contextlib.suppress(ValueError):
            yield ipaddress.IPv4Network(words[field], strict=False)


def sweep() -> list[str]:
    """Remove the clusters whose owner no longer runs (a pytest that was SIGKILLed) and
    return their tags."""
    swept = []
    for path in sorted(RECORDS.glob("*.json")) if RECORDS.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _start_time(record["owner"]) == record["owner_start"]:
            continue  # its owner still runs: another test run's cluster
        remove(path.stem, record["namespaces"], record["links"])
        if not leftovers(record["namespaces"], record["links"]):
            path.unlink(missing_ok=True)
            swept.append(path.stem)
    return swept


def remove(tag: str, namespaces: Sequence[str], links: Sequence[str]) -> None:
    """Kill what runs in each namespace, then delete the namespaces (their veths go with
    them) and the links; what is already gone is skipped."""
    present = set(_ip("netns", "list", check=False).stdout.split())
    for namespace in namespaces:
        if namespace not in present:
            continue
        for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", namespace, check=False)
    for link in links:
        if Path(f"/sys/class/net/{link}").exists():
            _ip("link", "del", link, check=False)


def leftovers(namespaces: Sequence[str], links: Sequence[str]) -> list[str]:
    """The namespaces and links of `namespaces` and `links` that still exist."""
    present = set(_ip("netns", "list", check=False).stdout.split())
    return [n for n in namespaces if n in present] + [
        link for link in links if Path(f"/sys/class/net/{link}").exists()
    ]


def _neighbours(namespace: str | None, device: str, entries: Sequence[tuple[str, str]]) -> None:
    """Permanent neighbour entries on `device`: no ARP, so a cut host is silent, not
    unreachable."""
    batch = "".join(
        f"neigh replace {address} lladdr {mac} dev {device} nud permanent\n"
        for address, mac in entries
    )
    where = ["-n", namespace] if namespace else []
    _run(["ip", *where, "-batch", "-"], stdin=batch, check=True)


def _start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), telling it from a later
    process given the same pid; None if it does not run."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def _run(argv: list[str], stdin: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise ServiceError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done
