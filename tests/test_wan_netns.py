"""The emulated WAN (training/bench/wan/netns.py, bucket.py).

Pure parts (names, addresses, tbf arguments) always run. The rest needs root and iproute2 and
skips with the reason where they are missing; the shaped-throughput and bucket round-trip tests
are slow (a few seconds of shaped traffic each, fake-gcs-server in the backbone).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from training.bench.wan import netns
from training.bench.wan.netns import BUCKET_ADDR, Wan, WanError, plan, tbf_args

REASON = netns.unavailable()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"WAN harness: {REASON}")


def test_plan_gives_each_region_its_own_slash30_and_short_device_names() -> None:
    p = plan("dwt0", 3)
    assert p.namespaces == ("dwt0-bb", "dwt0-r0", "dwt0-r1", "dwt0-r2")
    assert [(x.backbone_addr, x.region_addr) for x in p.links] == [
        ("10.213.0.1", "10.213.0.2"),
        ("10.213.1.1", "10.213.1.2"),
        ("10.213.2.1", "10.213.2.2"),
    ]
    assert all(len(x.region_dev) <= 15 and len(x.backbone_dev) <= 15 for x in p.links)


@pytest.mark.parametrize("prefix", ["", "a", "UPPER", "toolongpre", "a-b", "dw_x"])
def test_plan_refuses_prefixes_that_cannot_name_interfaces(prefix: str) -> None:
    with pytest.raises(ValueError):
        plan(prefix, 2)


def test_tbf_rate_is_in_kbit_and_burst_never_below_16_kib() -> None:
    args = tbf_args(1.5)
    assert args[:3] == ["tbf", "rate", "1500kbit"]
    assert int(args[args.index("burst") + 1]) == 16 * 1024
    assert int(tbf_args(1000.0)[4]) == int(1000e6 / 8 * 0.004)


def test_tbf_refuses_a_zero_rate() -> None:
    with pytest.raises(ValueError):
        tbf_args(0.0)


@needs_root
def test_teardown_leaves_no_namespace_and_setup_twice_is_idempotent() -> None:
    wan = Wan(regions=2, prefix="dwtidem")
    try:
        wan.setup()
        wan.setup()  # removes the first one, builds again
        assert set(wan.plan.namespaces) <= netns.existing_namespaces()
    finally:
        wan.teardown()
        wan.teardown()
    assert not set(wan.plan.namespaces) & netns.existing_namespaces()


@needs_root
def test_a_failed_setup_removes_what_it_built(monkeypatch: pytest.MonkeyPatch) -> None:
    real = netns._run

    def failing(argv, check=True):
        if "veth" in argv:
            raise WanError("injected")
        return real(argv, check)

    monkeypatch.setattr(netns, "_run", failing)
    wan = Wan(regions=2, prefix="dwtfail")
    with pytest.raises(WanError, match="injected"):
        wan.setup()
    monkeypatch.undo()
    assert not set(wan.plan.namespaces) & netns.existing_namespaces()


@needs_root
def test_teardown_kills_processes_left_in_the_namespaces() -> None:
    with Wan(regions=1, prefix="dwtkill") as wan:
        proc = subprocess.Popen(wan.command(wan.region(0), ["sleep", "600"]))
    assert proc.wait(timeout=10) != 0


@needs_root
def test_a_region_reaches_only_the_backbone_subnet() -> None:
    with Wan(regions=2, prefix="dwtroute") as wan:
        routes = wan.run(wan.region(0), ["ip", "-j", "route", "show"]).stdout
    dests = sorted(r["dst"] for r in json.loads(routes))
    assert dests == ["10.213.0.0/16", "10.213.0.0/30"]


# -- slow: real traffic through shaped links --------------------------------------------------

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
n = 0
while not n:  # a connection that sends nothing (the readiness probe) does not count
    c, _ = s.accept(); t0 = None
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        t0 = t0 or time.monotonic(); n += len(b)
print(n * 8 / (time.monotonic() - t0) / 1e6)
"""

_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
buf = b"x" * (1 << 16)
for _ in range(int(sys.argv[3]) // len(buf)):
    c.sendall(buf)
c.close()
"""


@needs_root
@pytest.mark.slow
def test_a_shaped_link_carries_its_rate_within_20_percent() -> None:
    mbit = 8.0
    with Wan(regions=1, prefix="dwtrate") as wan:
        wan.shape(mbit)
        sink = wan.popen(
            wan.backbone, [sys.executable, "-c", _SINK, BUCKET_ADDR, "5009"], stdout=subprocess.PIPE
        )
        from training.bench.wan.bucket import wait_listening

        wait_listening(wan, wan.backbone, BUCKET_ADDR, 5009)
        nbytes = int(mbit * 1e6 / 8 * 4)  # four seconds at the rate
        wan.run(wan.region(0), [sys.executable, "-c", _SOURCE, BUCKET_ADDR, "5009", str(nbytes)])
        measured = float(sink.communicate(timeout=60)[0])
    assert abs(measured - mbit) / mbit < 0.2, f"{measured:.2f} Mbit/s through an {mbit} link"


@needs_root
@pytest.mark.slow
@pytest.mark.integration
def test_a_region_writes_and_reads_the_bucket_in_the_backbone(tmp_path) -> None:
    from training.bench.wan.bucket import start_bucket

    code = (
        "from training.store.registry import open_store\n"
        "s = open_store('gs://wan/rt'); s.check()\n"
        "s.write('a/b.bin', bytes(range(256)) * 1000)\n"
        "print(s.read('a/b.bin') == bytes(range(256)) * 1000)\n"
    )
    with Wan(regions=2, prefix="dwtstore") as wan:
        bucket = start_bucket(wan, tmp_path)
        before = wan.counters()[1]
        out = wan.run(wan.region(1), [sys.executable, "-c", code], env=bucket.env).stdout
        after = wan.counters()[1]
    assert out.strip() == "True"
    assert after["up"] - before["up"] > 256_000 and after["down"] - before["down"] > 256_000
