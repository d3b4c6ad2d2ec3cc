"""The --hosts benches' flags (kdn.bench.harness.check_host_flags): --cap and --own-cores
need --hosts, and --own-cores a CPU per host; l2's `--plane ray` is refused with --hosts; each
refused before anything starts, naming the flag."""
import importlib
import os

import pytest


@pytest.mark.parametrize("bench", ["transport", "fetch", "l2"])
@pytest.mark.parametrize("flags,says", [(["--cap", "1gbit"], "--cap needs --hosts"),
                                        (["--own-cores"], "--own-cores needs --hosts")])
def test_host_flags_without_hosts_are_refused_naming_the_flag(bench, flags, says, capsys):
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"kdn.bench.{bench}").main(flags)
    assert done.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) >= 3, reason="this machine has a CPU for each of l2's 3 hosts")
def test_own_cores_with_more_hosts_than_cpus_is_refused_before_anything_starts(capsys):
    from kdn.bench import l2
    with pytest.raises(SystemExit) as done:
        l2.main(["--hosts", "--own-cores"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--own-cores: 3 hosts with cores of their own need as many CPUs" in err


def test_l2_over_ray_with_hosts_is_refused_before_anything_starts(capsys):
    """With --hosts the edges serve HTTP on their hosts' addresses: `--plane ray` cannot hold."""
    from kdn.bench import l2
    with pytest.raises(SystemExit) as done:
        l2.main(["--hosts", "--plane", "ray"])
    assert done.value.code == 2 and "--plane ray: with --hosts" in capsys.readouterr().err
