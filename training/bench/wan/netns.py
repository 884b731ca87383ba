"""An emulated WAN on one machine: regions in network namespaces around a backbone.

    with Wan(regions=2) as wan:          # needs root and iproute2 (`ip`, `tc`)
        wan.shape(mbit=12.0)             # every link: tbf at 12 Mbit/s each way
        p = wan.popen(wan.region(0), ["python", "-m", "..."], env=...)
        wan.counters()                   # bytes up / down per region, from the veth counters

Topology (`plan()`): one namespace `<prefix>-bb` (the backbone, where the bucket and the merger
live) and one `<prefix>-r<i>` per region. Region i is joined to the backbone by one veth pair on
the /30 `10.213.i.0`: the backbone side is `10.213.i.1`, the region side `10.213.i.2`. The backbone
forwards between links (region to region traffic crosses two shaped links, as over a WAN) and owns
the bucket address `10.213.255.1` on its loopback. Each region routes only `10.213.0.0/16` to the
backbone. These namespaces hold no other interface, so nothing in them can reach any address but
their own: no traffic leaves the machine.

Shaping: `tc qdisc replace ... tbf` on both ends of every veth: the region side's egress is the
region's upload, the backbone side's egress its download. `shape(None)` removes the qdiscs.

Lifecycle: `Wan.__enter__` (= `setup()`) first removes anything left under the same prefix, then
builds; on any error it tears down what it built and re-raises. `teardown()` kills every process
still in the namespaces (they were started there by us) and deletes the namespaces, which deletes
their veths; it is idempotent and never raises for what is already gone. Names carry a unique
prefix (`dwan<6 hex>` by default), so concurrent harnesses never collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SUBNET = "10.213.0.0/16"
BUCKET_ADDR = "10.213.255.1"
MAX_REGIONS = 200
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


class WanError(RuntimeError):
    """A namespace command failed; the message is one line naming it."""


@dataclass(frozen=True)
class Link:
    """One region's veth pair: `region_dev` lives in the region, `backbone_dev` in the backbone."""

    region: int
    region_ns: str
    region_dev: str
    region_addr: str  # 10.213.i.2
    backbone_dev: str
    backbone_addr: str  # 10.213.i.1


@dataclass(frozen=True)
class Plan:
    prefix: str
    backbone: str
    links: tuple[Link, ...]

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.backbone, *(link.region_ns for link in self.links))


def plan(prefix: str, regions: int) -> Plan:
    """Names and addresses of a WAN of `regions` regions (pure; no system call).

    `prefix` is 2 to 8 characters of [a-z0-9] (interface names must fit Linux's 15 bytes).
    """
    if not (2 <= len(prefix) <= 8 and prefix.isascii() and prefix.isalnum() and prefix.islower()):
        raise ValueError(f"prefix {prefix!r}: 2 to 8 lowercase letters or digits")
    if not 1 <= regions <= MAX_REGIONS:
        raise ValueError(f"regions {regions}: 1 to {MAX_REGIONS}")
    links = tuple(
        Link(
            region=i,
            region_ns=f"{prefix}-r{i}",
            region_dev=f"{prefix}r{i}",
            region_addr=f"10.213.{i}.2",
            backbone_dev=f"{prefix}b{i}",
            backbone_addr=f"10.213.{i}.1",
        )
        for i in range(regions)
    )
    return Plan(prefix=prefix, backbone=f"{prefix}-bb", links=links)


def tbf_args(mbit: float) -> list[str]:
    """`tc qdisc` arguments of a token bucket at `mbit` Mbit/s (pure).

    The bucket holds 4 ms of traffic but at least 16 KiB (several full frames), so short bursts
    are not counted as shaping error. The queue holds 50 ms, beyond which tbf drops and TCP backs
    off: a longer queue (500 ms was tried) delays the ACKs of the opposite direction's flow behind
    the data in it, and two-way bulk transfers (an all-reduce) then got about half the rate; at
    50 ms they get about three quarters of it (measured, docs/WAN.md), one-way transfers ~96%.
    """
    if not mbit > 0:
        raise ValueError(f"rate {mbit!r} Mbit/s must be > 0")
    burst = max(16 * 1024, int(mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{mbit * 1000:.0f}kbit", "burst", str(burst), "latency", "50ms"]


def unavailable() -> str | None:
    """Why the harness cannot run here (not root, no `ip` / `tc`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        raise WanError(f"{' '.join(argv)}: {err[0] if err else f'exit {proc.returncode}'}")
    return proc


def existing_namespaces() -> set[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process in a namespace: ours without proxy settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
    env.update(extra or {})
    return env


class Wan:
    """The emulated WAN (see the module docstring); use as a context manager."""

    def __init__(self, regions: int = 2, prefix: str | None = None):
        self.plan = plan(prefix or f"dwan{uuid.uuid4().hex[:4]}", regions)
        self.procs: list[subprocess.Popen] = []
        self.rate_mbit: float | None = None

    # -- names ------------------------------------------------------------------------------

    @property
    def backbone(self) -> str:
        return self.plan.backbone

    def region(self, i: int) -> str:
        return self.plan.links[i].region_ns

    def region_addr(self, i: int) -> str:
        return self.plan.links[i].region_addr

    @property
    def regions(self) -> int:
        return len(self.plan.links)

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Wan:
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> None:
        reason = unavailable()
        if reason:
            raise WanError(f"cannot build the WAN: {reason}")
        self.teardown()  # anything left under this prefix
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise

    def _build(self) -> None:
        p, bb = self.plan, self.plan.backbone
        for ns in p.namespaces:
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", bb, "addr", "add", f"{BUCKET_ADDR}/32", "dev", "lo"])
        _run(["ip", "netns", "exec", bb, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        for link in p.links:
            # create both ends inside the backbone, then move one: nothing ever sits in ours
            _run(
                ["ip", "-n", bb, "link", "add", link.backbone_dev, "type", "veth"]
                + ["peer", "name", link.region_dev, "netns", link.region_ns]
            )
            _run(
                [
                    "ip",
                    "-n",
                    bb,
                    "addr",
                    "add",
                    f"{link.backbone_addr}/30",
                    "dev",
                    link.backbone_dev,
                ]
            )
            _run(
                [
                    "ip",
                    "-n",
                    link.region_ns,
                    "addr",
                    "add",
                    f"{link.region_addr}/30",
                    "dev",
                    link.region_dev,
                ]
            )
            _run(["ip", "-n", bb, "link", "set", link.backbone_dev, "up"])
            _run(["ip", "-n", link.region_ns, "link", "set", link.region_dev, "up"])
            _run(["ip", "-n", link.region_ns, "route", "add", SUBNET, "via", link.backbone_addr])

    def teardown(self) -> None:
        """Stop our processes and delete our namespaces (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
        present = existing_namespaces()
        for ns in self.plan.namespaces:
            if ns not in present:
                continue
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            _run(["ip", "netns", "del", ns], check=False)
        self.rate_mbit = None

    # -- shaping and counters ---------------------------------------------------------------

    def shape(self, mbit: float | None) -> None:
        """Shape every link to `mbit` Mbit/s each way (None: unshaped)."""
        for link in self.plan.links:
            for ns, dev in ((link.region_ns, link.region_dev), (self.backbone, link.backbone_dev)):
                tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
                if mbit is None:
                    _run([*tc, "del", "dev", dev, "root"], check=False)
                else:
                    _run([*tc, "replace", "dev", dev, "root", *tbf_args(mbit)])
        self.rate_mbit = mbit

    def counters(self) -> list[dict[str, int]]:
        """Per region, bytes sent up (region to backbone) and down, as counted by the veth."""
        out = []
        for link in self.plan.links:
            text = _run(["ip", "-n", link.region_ns, "-j", "-s", "link", "show", link.region_dev])
            stats = json.loads(text.stdout)[0]["stats64"]
            out.append(dict(up=int(stats["tx"]["bytes"]), down=int(stats["rx"]["bytes"])))
        return out

    # -- processes --------------------------------------------------------------------------

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        if ns not in self.plan.namespaces:
            raise ValueError(f"{ns!r} is not a namespace of this WAN")
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw):
        """Start `argv` in namespace `ns` (killed at teardown if still running)."""
        proc = subprocess.Popen(self.command(ns, argv), env=child_env(env), **kw)
        self.procs.append(proc)
        return proc

    def run(
        self,
        ns: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run `argv` in `ns` to completion; raise WanError (with its last stderr line) on failure."""
        proc = subprocess.run(
            self.command(ns, argv),
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            raise WanError(
                f"{argv[0]} in {ns} exited {proc.returncode}: {tail[-1] if tail else ''}"
            )
        return proc
