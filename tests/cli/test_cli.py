"""The `kdn` command in-process (`kdn.cli.main`) against a network on the test cluster.

`kdn up`, `kdn status` and `kdn down` as separate processes on their own embedded cluster are
tests/test_readme.py's: it runs the README's commands as written and, on that same cluster,
the errors a user meets there (bad codecs refused before anything starts, an unknown KB, a
missing file, a second publish that prefills nothing) and that nothing outlives `kdn down`.

These tests call `kdn.cli.main` in-process against a network on the test cluster: publishing
new namespaces with read tokens on, refusals that come before the model loads, and errors
(remote ones included) printed as one clean line. A real codebase: this repository's own
`kdn/placement/` folder is refused whole (longer than the model's context) before any prefill;
two of the repository's small files, selected from its root by --include
(`kdn/core/wire.py`, `kdn/placement/__init__.py`), are published with the real model (loaded once
for the module) and queried: the documents are named by their paths relative to the root,
and the answer's prompt starts with the KB's tokens, whose KV comes from KDN.
"""
import json
import time
from pathlib import Path

import pytest

from kdn.cli.knowledge import bundled_documents

REPO = Path(__file__).resolve().parents[2]



# --- in-process: `kdn.cli.main` against a network on the test cluster ------------------------
ADMIN = "admin-secret-0123456789abcdef"


@pytest.fixture
def read_tokens_net(ray_cluster, tmp_path, network_name, monkeypatch):
    """A network with read tokens on (tenants a and b), as `KDN_READ_TOKENS=a=..,b=.. kdn up`
    starts it; the CLI finds it by --address/--network and its admin token in the environment."""
    from kdn.launch.cluster import start_network, stop_network
    from kdn.placement.topology import Topology
    topo = Topology.default_local(["us-east", "eu-west"], edges_per_region=1, capacity_bytes=128 << 20)
    net = start_network(topo, tmp_path / "origin", network=network_name,
                        auth={"admin": ADMIN, "readers": {"a": "a-read-token-0123456789",
                                                          "b": "b-read-token-0123456789"}})
    monkeypatch.setenv("KDN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)
    monkeypatch.delenv("KDN_TOKEN", raising=False)
    yield ["--address", ray_cluster.address, "--network", net.name]
    stop_network(net)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kdn: error: "), err
    assert "Traceback" not in err and "\x1b" not in err, err
    return lines[0]


def test_publish_command_with_read_tokens_on_publishes_new_namespaces(read_tokens_net, tmp_path, capsys,
                                                                     monkeypatch):
    from kdn.cli import main
    doc = tmp_path / "gamma.txt"
    doc.write_text(dict(bundled_documents())["gettysburg-address"], encoding="utf-8")
    assert main(["publish", "gamma", str(doc)] + read_tokens_net) == 0, capsys.readouterr().err
    assert "default/gamma v1 committed" in capsys.readouterr().out
    assert main(["publish", "gamma", str(doc), "--tenant", "a"] + read_tokens_net) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "a/gamma v1 committed" in out and "reused 0 from the network" in out
    # a wrong admin token: refused by the origin (a remote error) in one clean line
    monkeypatch.setenv("KDN_ADMIN_TOKEN", "w" * 30)
    assert main(["publish", "gamma", str(doc)] + read_tokens_net) == 2
    assert "admin token" in _one_error_line(capsys.readouterr().err)


def test_too_large_a_publish_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import kdn.engines.transformers.model
    from kdn.cli import main
    from kdn.client.documents import MAX_KB_BYTES
    monkeypatch.setattr(kdn.engines.transformers.model, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:                 # text first (a NUL there is binary), then sparse
        f.write(b"Some knowledge.\n" * 1000)
        f.truncate(MAX_KB_BYTES + 1)
    t0 = time.perf_counter()
    assert main(["publish", "kb", str(big), "--address", "127.0.0.1:1"]) == 2
    assert time.perf_counter() - t0 < 1.0
    assert "over the" in _one_error_line(capsys.readouterr().err)
    small = tmp_path / "small.txt"
    small.write_text("Some knowledge.", encoding="utf-8")
    assert main(["publish", "../kb", str(small), "--address", "127.0.0.1:1"]) == 2
    assert "knowledge base name must match" in _one_error_line(capsys.readouterr().err)


def test_errors_print_one_line_without_tracebacks_or_escape_codes(ray_cluster, capsys, monkeypatch):
    import ray
    import kdn.cli as cli
    import kdn.cli.cluster as cluster
    from kdn.core.errors import NetworkError

    def refused(args, rest):
        raise NetworkError("\x1b[31mred\x1b[0m alert\nsecond line\x07 \x1b]0;title\x07end")
    monkeypatch.setattr(cluster, "_status", refused)
    assert cli.main(["status"]) == 2
    assert _one_error_line(capsys.readouterr().err) == "kdn: error: red alert second line end"

    @ray.remote
    def buggy():
        raise ValueError("\x1b[1mwrong\x1b[0m value\nin a node")

    monkeypatch.setattr(cluster, "_status", lambda args, rest: ray.get(buggy.remote()))
    assert cli.main(["status"]) == 1
    assert _one_error_line(capsys.readouterr().err) == \
        "kdn: error: unexpected ValueError in a KDN node: wrong value in a node"


def test_status_of_a_dead_recorded_cluster_fails_at_once(tmp_path, capsys, monkeypatch):
    from kdn.cli import main
    from kdn.launch.cluster import free_ports
    home = tmp_path / "home"
    home.mkdir()
    port = free_ports(1)[0]                    # nobody listens there: the cluster died
    (home / "cluster.json").write_text(json.dumps({"network": "kdn", "address": f"127.0.0.1:{port}",
                                                   "root": str(tmp_path), "pids": [], "embedded": True}))
    monkeypatch.setenv("KDN_HOME", str(home))
    t0 = time.perf_counter()
    assert main(["status"]) == 2
    assert time.perf_counter() - t0 < 5.0
    assert "is not running" in _one_error_line(capsys.readouterr().err)


def test_status_shows_an_edges_disk_tier_beside_memory():
    from kdn.cli.cluster import status_rows
    tier = {"items": 2, "bytes": 3 << 20}
    edge = {"name": "e-0", "region": "r", "main": tier, "hot": tier, "hot_copies": 2,
            "counters": {"chunks_served": 4, "served_local": 4},
            "disk": {"items": 7, "bytes": 5 << 30, "hits": 3, "write_backs": 9, "full_dropped": 1}}
    row, = status_rows({"edges": [edge]})
    assert row["chunks"] == 4 and row["disk chunks"] == 7 and row["disk"] == "5.00 GiB"
    assert row["main"] == "2 / 3.0 MiB" and row["hot"] == "2 / 3.0 MiB" and row["main hits"] == 0
    assert row["disk hits"] == 3 and row["write-backs"] == 9 and row["dropped (full)"] == 1
    row, = status_rows({"edges": [dict(edge, disk=None)]})
    assert "disk" not in row and "peer pulls (http / ray)" not in row     # none yet: no column
    plane = {"mode": "auto", "peer_http_pulls": 5, "peer_http_bytes": 3 << 30, "peer_ray_pulls": 1}
    row, = status_rows({"edges": [dict(edge, data_plane=plane)]})
    assert row["peer pulls (http / ray)"] == "5 (3.00 GiB) / 1"
    assert "store allocated ahead" not in row                             # no fill: no column
    fill = {"running": True, "filled_bytes": 1 << 30, "fill_stopped_why": None}
    row, = status_rows({"edges": [dict(edge, object_store_fill=fill)]})
    assert row["store allocated ahead"] == "1.00 GiB (filling)"
    row, = status_rows({"edges": [dict(edge, object_store_fill=dict(fill, running=False))]})
    assert row["store allocated ahead"] == "1.00 GiB"
    row, = status_rows({"edges": [dict(edge, object_store_fill=dict(fill, running=False, fill_stopped_why="x"))]})
    assert row["store allocated ahead"] == "1.00 GiB (stopped short)"


def test_status_says_how_the_origins_pushes_travelled():
    from kdn.cli.cluster import push_line
    assert push_line({"chunks_pushed": 0}) == ""
    assert push_line({"push_http_chunks": 36, "push_http_bytes": 2 * 10**9, "push_http_us": 2 * 10**6,
                      "push_ray_chunks": 18, "push_ray_bytes": 10**9, "push_ray_us": 4 * 10**6}) == (
        "origin pushes: 36 chunks pulled by edges on other nodes from its HTTP frames (1.00 GB/s); "
        "18 chunks over Ray (0.25 GB/s)")
    # batches in flight together on a path: the pace is over the time it was busy, not their times added
    assert push_line({"push_http_chunks": 36, "push_http_bytes": 2 * 10**9, "push_http_us": 2 * 10**6,
                      "push_http_busy_us": 10**6}) == (
        "origin pushes: 36 chunks pulled by edges on other nodes from its HTTP frames (2.00 GB/s)")


def test_status_says_how_bulk_writes_reached_the_origin():
    from kdn.cli.cluster import writes_line
    assert writes_line({"objects_received": 3}, None) == ""
    assert writes_line({"objects_pulled_http": 8, "object_pull_http_bytes": 10**9, "object_pull_http_us": 10**6,
                        "object_refs_read": 4, "object_ref_bytes": 10**9, "object_ref_us": 4 * 10**6},
                       {"ingest_chunks_frames": 32, "ingest_chunks_bytes": 10**9, "ingest_chunks_receive_us": 10**6,
                        "ingest_chunks_store_us": 10**6}) == (
        "origin takes: 32 chunks written to its HTTP server (0.50 GB/s, durable); 8 stored objects pulled "
        "from edges' frames (1.00 GB/s); 4 stored objects handed over by edges over Ray (0.25 GB/s)")


# --- a codebase: this repository's kdn/placement/ folder, with the real model --------------------
@pytest.fixture(scope="module")
def code_net(small_network, ray_cluster):
    """A network with an admin token (no read tokens); the CLI's arguments to reach it."""
    net = small_network(auth={"admin": ADMIN})
    return ["--address", ray_cluster.address, "--network", net.name]


@pytest.fixture
def cli_env(tmp_path, monkeypatch, model):
    """The CLI in-process: KDN_HOME in tmp_path, the admin token in the environment, and
    load_model() answering the module's model (one load per module)."""
    import kdn.engines.transformers.model
    monkeypatch.setenv("KDN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)
    monkeypatch.delenv("KDN_TOKEN", raising=False)
    monkeypatch.setattr(kdn.engines.transformers.model, "load_model", lambda *a, **k: model)
    return model


def _no_model(monkeypatch):
    import kdn.engines.transformers.model
    monkeypatch.setattr(kdn.engines.transformers.model, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def test_the_cli_knows_the_models_fingerprint_without_loading_it(model):
    from kdn.cli.kb import _model_fingerprint
    assert _model_fingerprint() == model.fingerprint


def test_a_codebase_folder_is_published_by_relative_paths_and_answered_from_kdn(code_net, cli_env, capsys, monkeypatch):
    from kdn.cli import main
    from kdn.client import Client
    model = cli_env
    placement = REPO / "kdn" / "placement"
    # the whole folder (~26k tokens) is longer than SmolLM2's context: refused before any prefill
    t0 = time.perf_counter()
    assert main(["publish", "placement", str(placement)] + code_net) == 2
    out, err = capsys.readouterr()
    files = [p for p in placement.iterdir() if p.is_file()]          # (__pycache__ is skipped)
    assert f"documents: {len(files)} documents" in out and f"named relative to {placement}" in out
    line = _one_error_line(err)
    context = model.hf.config.max_position_embeddings
    assert f"the model's context is {context} tokens (max_position_embeddings)" in line
    assert "no prompt could use it whole" in line and "--allow-over-context" in line and "several KBs" in line
    assert time.perf_counter() - t0 < 15, "refused after tokenizing, before the prefill"

    # two small files picked from the repository's root by --include (a small KB: a short
    # prefill), named by their paths relative to it; the walk skips .git and .venv
    files = ["kdn/core/wire.py", "kdn/placement/__init__.py"]
    args = ["publish", "code", str(REPO)] + [a for f in files for a in ("--include", f)]
    assert main(args + code_net) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "documents: 2 documents" in out and f"named relative to {REPO}" in out
    assert "default/code v1 committed" in out
    cl = Client(network=code_net[3], region="eu-west", fingerprint=model.fingerprint, admin_token=ADMIN)
    m = cl.manifest("code")
    assert [d.name for d in m.documents] == files
    texts = [(REPO / n).read_text() for n in files]
    kb_tokens = model.knowledge_tokens("\n\n".join(texts))
    assert m.token_ids().tolist() == kb_tokens and m.n_tokens < context
    assert model.tokenizer.decode(m.token_ids()[:40].tolist()).startswith("<|im_start|>system\n" + texts[0][:40])
    # the question's prompt starts with the KB's tokens, and all of their KV comes from KDN
    question = "How does an edge say where each chunk came from?"
    assert model.prompt_tokens("\n\n".join(texts), question)[:m.n_tokens] == kb_tokens
    assert main(["query", "code", question, "--region", "eu-west", "--max-new-tokens", "4"] + code_net) == 0
    out, err = capsys.readouterr()
    assert out.strip(), "the answer is printed"
    prompt = len(kb_tokens) + len(model.question_tokens(question))
    assert f"{m.n_tokens}/{prompt} prompt tokens from KDN" in err, err
    # the same tree again: the same KB, no new version, nothing prefilled, and no model loaded
    # (the tokenizer alone finds every chunk held)
    _no_model(monkeypatch)
    assert main(args + code_net) == 0
    out = capsys.readouterr().out
    assert "default/code v1 unchanged" in out and "prefilled 0 tokens" in out and "sent 0 chunks" in out


def test_query_and_publish_refusals_come_before_the_model_loads(code_net, tmp_path, capsys, monkeypatch):
    from kdn.cli import main
    monkeypatch.setenv("KDN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)
    monkeypatch.delenv("KDN_TOKEN", raising=False)
    _no_model(monkeypatch)
    for argv, problem in ((["no-such-kb", "Anything?"], "no knowledge base 'no-such-kb'"),
                          (["kb", "Anything?", "--region", "mars"], "region 'mars' is not in the network's topology"),
                          (["kb", "Anything?", "--accept", "gzip"], "unknown codec(s) 'gzip'"),
                          (["kb", "Anything?", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
                          (["kb", "  "], "the question is empty"),
                          (["../kb", "Anything?"], "knowledge base name must match")):
        t0 = time.perf_counter()
        assert main(["query"] + argv + code_net) == 2, argv
        assert problem in _one_error_line(capsys.readouterr().err), argv
        assert time.perf_counter() - t0 < 10, argv
    # a folder with nothing to publish, a named binary file, a wrong admin token: no model either
    folder = tmp_path / "assets"
    folder.mkdir()
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    (folder / "__init__.py").write_text("")
    assert main(["publish", "kb", str(folder)] + code_net) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "nothing to publish" in line and "1 binary: logo.png" in line and "1 empty: __init__.py" in line
    assert main(["publish", "kb", str(folder / "logo.png")] + code_net) == 2
    assert "logo.png: not UTF-8 text (invalid start byte at byte 0)" in _one_error_line(capsys.readouterr().err)
    (folder / "ok.md").write_text("Some knowledge.\n")
    monkeypatch.setenv("KDN_ADMIN_TOKEN", "w" * 30)
    assert main(["publish", "kb", str(folder)] + code_net) == 2
    out, err = capsys.readouterr()
    assert "skipped 1 binary, 1 empty" in out and "admin token" in _one_error_line(err)


def test_emphasis_at_publish_and_by_kdn_emphasize_is_the_kbs_override(code_net, cli_env, tmp_path, capsys):
    """`kdn publish --emphasis` marks a document (the KB's override, its edit stored), `kdn
    emphasize` changes or clears it (again and again: a weight of 1 is no emphasis), a document
    the KB lacks or a weight that is not ASCII digits is refused with the override unchanged,
    `kdn query` says it answers over the exact KV, `kdn status` lists the KB's own version and
    `kdn delete` retires it with its stored edits."""
    from kdn.cli import main
    from kdn.client import Client
    from kdn.core.emphasis import override_of
    (tmp_path / "old.md").write_text("Policy B12 (2019), superseded: the office opens at 2.")
    (tmp_path / "new.md").write_text("Policy B12 (2024), in force: the office opens at 8.")
    reader = Client(network=code_net[3], region="eu-west", fingerprint=cli_env.fingerprint, admin_token=ADMIN)

    def weights():
        reader.reader.forget_manifests()
        return override_of(reader.manifest("pol"))

    assert main(["publish", "pol", str(tmp_path), "--emphasis", "new.md=3"] + code_net) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "default/pol v1 committed" in out and "emphasis {'new.md': 3} on v1" in out and "exact=False" in out
    assert weights() == {"new.md": 3}
    assert main(["emphasize", "pol", "new.md=2"] + code_net) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "default/pol: emphasis {'new.md': 2}" in out and "emphasis {'new.md': 2} on v1" in out
    assert weights() == {"new.md": 2}
    assert main(["emphasize", "pol", "nope.md=2"] + code_net) == 2
    assert "names document 'nope.md'" in _one_error_line(capsys.readouterr().err)
    assert weights() == {"new.md": 2}
    assert main(["query", "pol", "When does the office open?", "--max-new-tokens", "2"] + code_net) == 0
    assert "has an emphasis override {'new.md': 2}; `kdn query` answers over its exact KV" in capsys.readouterr().err
    assert main(["emphasize", "pol", "--clear"] + code_net) == 0
    assert "emphasis cleared" in capsys.readouterr().out and weights() == {}
    # again and again (issue 35: the stored edits were taken for the KB, "it has: 'emphasized'")
    for argv, now in ((["new.md=4"], {"new.md": 4}), (["old.md=2", "new.md=3"], {"old.md": 2, "new.md": 3}),
                      (["--clear"], {}), (["new.md=2"], {"new.md": 2}), (["new.md=1"], {}),
                      (["new.md=5"], {"new.md": 5})):
        assert main(["emphasize", "pol", *argv] + code_net) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert (f"emphasis {now} on v1" in out if now else "emphasis cleared" in out) and weights() == now
    assert main(["emphasize", "pol", "new.md=\u0664"] + code_net) == 2      # ASCII digits only
    assert _one_error_line(capsys.readouterr().err) == (
        "kdn: error: emphasis weight of document 'new.md' must be an int in [1, 16] (a weight k adds "
        "log k to its tokens' attention logits), got '\u0664'")
    assert main(["emphasize", "pol", "nope.md=1"] + code_net) == 2         # a weight of 1 names a document too
    assert "names document 'nope.md'" in _one_error_line(capsys.readouterr().err) and weights() == {"new.md": 5}
    # status lists the KB's own version; its stored edits (3, 2, 4, {2, 3}, 5) are counted apart
    assert main(["status", "--json"] + code_net) == 0
    origin = json.loads(capsys.readouterr().out)["origin"]
    assert [k for k in origin["kbs"] if k["name"] == "pol"] == \
        [{"tenant": "default", "name": "pol", "fingerprint": cli_env.fingerprint, "versions": [1]}]
    assert origin["store"]["emphasized_copies"] == 5
    listed = lambda: reader.view.origin().manifests(name="pol")
    assert len(listed()) == 6
    assert main(["delete", "pol", "1"] + code_net) == 0, capsys.readouterr().err
    assert "default/pol@v1 retired with its 5 emphasized copies" in capsys.readouterr().out
    assert listed() == []                                                # the copies went with it
    assert main(["emphasize", "pol", "new.md=2"] + code_net) == 2
    assert "no committed knowledge base default/pol" in _one_error_line(capsys.readouterr().err)


def test_a_kb_whose_chunks_are_all_held_commits_without_the_model_unless_its_override_needs_it(
        code_net, cli_env, tmp_path, capsys, monkeypatch):
    """`kdn publish` of documents whose every chunk the origin holds loads no model: unchanged,
    no new version; renamed, a new version whose KV comes from the network. The KB's emphasis
    override on that new version needs its edited chunks, so that publish loads the model."""
    import kdn.engines.transformers.model
    from kdn.cli import main
    loads = []
    monkeypatch.setattr(kdn.engines.transformers.model, "load_model", lambda *a, **k: loads.append(1) or cli_env)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Rule A: badges are worn at all times.")
    (docs / "b.md").write_text("Rule B: visitors sign in at the desk.")
    assert main(["publish", "held", str(docs), "--emphasis", "a.md=2"] + code_net) == 0, capsys.readouterr().err
    assert "default/held v1 committed" in capsys.readouterr().out and len(loads) == 1
    from kdn.engines.transformers.engine import TransformersEngine     # from here on, no KV is computed
    monkeypatch.setattr(TransformersEngine, "publish", lambda *a, **k: pytest.fail("the engine published"))
    assert main(["publish", "held", str(docs)] + code_net) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "default/held v1 unchanged" in out and "prefilled 0 tokens" in out and len(loads) == 1
    (docs / "b.md").rename(docs / "c.md")                # the same text, another name: a new version
    assert main(["publish", "held", str(docs)] + code_net) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "default/held v2 committed" in out and "prefilled 0 tokens" in out and "sent 0 chunks" in out
    assert "emphasis {'a.md': 2} on v2" in out and len(loads) == 2, out
