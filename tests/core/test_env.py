"""KDN's process environment (kdn/core/env.py): loopback only, even when ray was imported first."""
import os
import subprocess
import sys

from kdn.core.env import is_loopback


def test_importing_ray_first_still_keeps_ray_on_loopback():
    code = ("import ray\n"
            "from ray._private import ray_constants\n"
            "before = ray_constants.ENABLE_RAY_CLUSTER\n"
            "import kdn.core.env\n"
            "kdn.core.env.prepare_ray_env()\n"
            "from ray._private import services\n"
            "print(before, ray_constants.ENABLE_RAY_CLUSTER, services.get_node_ip_address())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, ip = out.stdout.split()
    assert before == "True"            # ray read an environment without KDN's settings ...
    assert after == "False" and ip == "127.0.0.1"     # ... and KDN's took effect anyway


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("example.com")
