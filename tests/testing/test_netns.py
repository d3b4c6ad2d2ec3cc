"""Namespaced hosts (kdn.testing.netns) without Ray: each host has its own address and reaches
the head through the bridge, a cap puts a token bucket on both ends of its link, a cut link
carries nothing, and down() leaves no namespace, veth or bridge behind."""
import os
import socket
import subprocess
import sys

import pytest

from kdn.bench.transport import link_rate
from kdn.testing import netns

why = netns.available()

CONNECT = ("import socket, sys\n"
           "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)\n"
           "s.sendall(sys.argv[3].encode()); s.close()")


SEND = ("import socket, sys\n"
        "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
        "block = bytes(64 << 20)\n"
        "for _ in range(4):\n"
        "    s.sendall(block)\n"
        "s.close()")


def _serve(host):
    s = socket.socket()
    s.bind((host, 0))
    s.listen(4)
    s.settimeout(5)
    return s, s.getsockname()[1]


@pytest.mark.skipif(why is not None, reason=f"namespaced hosts: {why}")
def test_hosts_have_their_own_addresses_caps_and_cuts_and_leave_nothing_behind():
    hosts = netns.Hosts(["a", "b"]).up()
    try:
        assert hosts.address("a") != hosts.address("b") != hosts.head
        srv, port = _serve(hosts.head)
        for name in ("a", "b"):
            r = hosts.run(name, [sys.executable, "-c", CONNECT, hosts.head, str(port), name],
                          capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            conn, (peer, _) = srv.accept()
            assert peer == hosts.address(name) and conn.recv(16) == name.encode()   # seen from its own address
            conn.close()
        # each flow is steered to one CPU at both ends, so a bulk send arrives in order: a veth
        # without it reorders a sender that moves CPUs, and TCP retransmits what was not lost
        def cpus(out):
            return int(out.stdout.replace(",", ""), 16)
        assert hosts.steered, "this machine's /sys takes rps_cpus: the links must be steered"
        steer, every = "cat /sys/class/net/{}/queues/rx-0/rps_cpus", sum(1 << c for c in os.sched_getaffinity(0))
        assert cpus(hosts.run("a", ["sh", "-c", steer.format("eth0")], capture_output=True, text=True)) == every
        assert cpus(subprocess.run(["sh", "-c", steer.format(hosts._veth["a"])], capture_output=True,
                                   text=True)) == every
        before = hosts.retransmitted("a")
        sender = hosts.popen("a", [sys.executable, "-c", SEND, hosts.head, str(port)], stderr=subprocess.PIPE)
        conn, _ = srv.accept()
        got, buf = 0, bytearray(1 << 20)
        while n := conn.recv_into(buf):
            got += n
        conn.close()
        assert sender.wait(timeout=60) == 0 and got == 256 << 20
        # unsteered, about 1,500 segments of 256 MiB were sent twice here; steered, a few tail
        # loss probes at most
        assert hosts.retransmitted("a") - before < 64
        hosts.steer("a", {0}, {0})           # a host's receive work on its own cores (HostCluster's cores)
        assert cpus(hosts.run("a", ["sh", "-c", steer.format("eth0")], capture_output=True, text=True)) == 1
        assert cpus(subprocess.run(["sh", "-c", steer.format(hosts._veth["a"])], capture_output=True,
                                   text=True)) == 1
        hosts.cap("a", "800mbit")
        shown = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
        inside = hosts.run("a", ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in shown and "800Mbit" in inside
        hosts.cut("b")
        r = hosts.run("b", [sys.executable, "-c", CONNECT, hosts.head, str(port), "b"],
                      capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "timed out" in r.stderr
        srv.close()
    finally:
        hosts.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in hosts.namespaces.values()) and hosts.bridge not in links


def test_a_link_rate_is_read_in_tcs_units_and_anything_else_is_refused():
    assert link_rate("2gbit") == 250e6 and link_rate("800mbit") == 100e6 and link_rate("1.5Gbit") == 187.5e6
    for bad in ("2gb", "fast", "", "-1gbit"):
        with pytest.raises(ValueError, match="--cap takes a rate"):
            link_rate(bad)


def test_own_cores_split_this_processes_cpus_among_the_hosts_or_say_there_are_too_few():
    mine = os.sched_getaffinity(0)
    alone = netns.own_cores(["near"])
    assert alone == {"near": mine}
    if len(mine) >= 2:
        split = netns.own_cores(["near", "far"])
        assert split["near"] | split["far"] == mine and split["near"] and split["far"]
        assert not split["near"] & split["far"]
    with pytest.raises(ValueError, match=f"{len(mine) + 1} hosts with cores of their own need as many CPUs"):
        netns.own_cores([f"h{i}" for i in range(len(mine) + 1)])


def test_a_clusters_cores_are_checked_before_anything_starts():
    mine = sorted(os.sched_getaffinity(0))
    assert netns._check_cores(["a", "b"], None) is None
    assert netns._check_cores(["a"], {"a": [mine[0]]}) == {"a": {mine[0]}}
    for cores, says in (({"a": {mine[0]}}, "cores names regions"), ({"a": set(), "b": {mine[0]}}, "non-empty subset"),
                        ({"a": {mine[0]}, "b": {max(mine) + 1}}, "non-empty subset"), ("mine", 'must be "own"')):
        with pytest.raises(ValueError, match=says):
            netns._check_cores(["a", "b"], cores)


def test_hosts_need_distinct_names():
    with pytest.raises(ValueError, match="distinct host names"):
        netns.Hosts(["a", "a"])


@pytest.mark.skipif(why is not None, reason=f"namespaced hosts: {why}")
def test_a_driver_joins_a_head_on_an_address_of_this_machine_there_and_any_other_on_loopback():
    """kdn.client.join.init_ray's default node address: a process joining a cluster whose
    head listens on one of this machine's addresses (HostCluster's bridge) runs on that node;
    a head on loopback, or elsewhere, keeps the driver on loopback."""
    from kdn.client.join import driver_ip
    assert driver_ip("local") == "127.0.0.1"
    assert driver_ip("127.0.0.1:6379") == "127.0.0.1"
    assert driver_ip("203.0.113.9:6379") == "127.0.0.1"      # TEST-NET-3: nobody's here
    with netns.Hosts(["a"]) as hosts:
        assert driver_ip(f"{hosts.head}:6379") == hosts.head
        assert driver_ip(f"{hosts.address('a')}:6379") == "127.0.0.1"   # the namespace's, not ours
