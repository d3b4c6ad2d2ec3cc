"""kdn/client/documents.py: files and folders -> documents. Any UTF-8 text is accepted, binary is
refused (named) or skipped and counted (walked) by its content, folders are walked in a
sorted, deterministic order with include/exclude globs and safe defaults, names are relative
paths valid in a manifest, and every limit is checked before a file is read whole.

No model and no network: the real-codebase publish is in tests/cli/test_cli.py.
"""
import os
import time
from pathlib import Path

import pytest

from kdn.client import documents as D
from kdn.core.errors import BadRequest
from kdn.core.manifest import Manifest

REPO = Path(__file__).resolve().parents[2]


def _write(root: Path, files: dict) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(data, bytes) else lambda d: p.write_text(d, encoding="utf-8"))(data)


TEXTS = {"main.py": "def f():\n    return 'héllo'\n", "conf/app.json": '{"a": [1, 2]}\n',
         "conf/app.yaml": "a: 1\n", "pyproject.toml": "[project]\nname = 'x'\n",
         "data.csv": "a,b\n1,2\n", "web/index.html": "<html><body>π</body></html>\n",
         "Makefile": "all:\n\techo ok\n", "lib.rs": "fn main() {}\n", "notes.md": "# Notes\n"}


def test_any_utf8_text_file_is_a_document_named_by_its_path(tmp_path):
    _write(tmp_path, TEXTS)
    sel = D.select_documents([tmp_path])
    assert sel.documents == sorted(sel.documents, key=lambda d: d[0].split("/"))
    assert dict(sel.documents) == TEXTS
    assert sel.skipped == {} and sel.root == tmp_path
    assert sel.bytes == sum(len(t.encode()) for t in TEXTS.values())
    # files named one by one: named relative to the folder holding them all
    got = D.read_documents([tmp_path / "web/index.html", tmp_path / "main.py"])
    assert got == [("web/index.html", TEXTS["web/index.html"]), ("main.py", TEXTS["main.py"])], "in the order given"
    assert D.read_documents([tmp_path / "conf/app.json"]) == [("app.json", TEXTS["conf/app.json"])]


def test_same_file_names_in_different_folders_do_not_collide(tmp_path):
    _write(tmp_path, {"a/x.py": "A = 1\n", "b/x.py": "B = 2\n"})
    assert D.read_documents([tmp_path / "a/x.py", tmp_path / "b/x.py"]) == [("a/x.py", "A = 1\n"),
                                                                             ("b/x.py", "B = 2\n")]
    assert D.read_documents([tmp_path]) == [("a/x.py", "A = 1\n"), ("b/x.py", "B = 2\n")]
    # a file named before its folder keeps its first place, and is read once
    assert D.read_documents([tmp_path / "b/x.py", tmp_path]) == [("b/x.py", "B = 2\n"), ("a/x.py", "A = 1\n")]


def test_a_named_binary_file_is_refused_by_its_content(tmp_path):
    cases = {"image.png": (b"\x89PNG\r\n\x1a\n" + bytes(64), "not UTF-8 text (invalid start byte at byte 0)"),
             "data.txt": (b"abc\0def", "binary content (a NUL byte at byte 3)"),
             "latin.py": ("x = 'caf\xe9'\n".encode("latin-1"), "not UTF-8 text (invalid continuation byte at byte 8)"),
             # binary content past the first bytes sniffed is found when the file is read
             "late.md": (b"a" * (D.SNIFF_BYTES + 100) + b"\0", f"a NUL byte at byte {D.SNIFF_BYTES + 100}")}
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(BadRequest) as e:
            D.read_documents([tmp_path / name])
        assert str(e.value).startswith(f"{tmp_path / name}: ") and why in str(e.value), str(e.value)
        assert "only text files can be published" in str(e.value)
    # a multi-byte character cut by the sniff is not binary
    cut = tmp_path / "cut.md"
    cut.write_bytes(b"a" * (D.SNIFF_BYTES - 1) + "é".encode() + b"\n")
    assert D.read_documents([cut])[0][1].endswith("é\n")


def test_a_walk_skips_hidden_pycache_binary_and_empty_files_and_counts_them(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/core.py": "X = 1\n", "pkg/blank.py": " \n\t\n",
                      "pkg/__pycache__/core.cpython-312.pyc": b"\x0d\x0d\r\n" + bytes(16),
                      "pkg/logo.png": b"\x89PNG\r\n\x1a\n" + bytes(32), "pkg/late.bin": b"x" * 9000 + b"\0",
                      ".git/config": "[core]\n", ".venv/lib/site.py": "import os\n", ".env": "SECRET=1\n",
                      "pkg/.hidden.py": "H = 1\n", "node_modules/left-pad/index.js": "module.exports = 1\n",
                      "README.md": "# Readme\n"})
    sel = D.select_documents([tmp_path])
    assert [n for n, _ in sel.documents] == ["README.md", "pkg/core.py"]
    assert sel.skipped == {"empty": ["pkg/__init__.py", "pkg/blank.py"], "binary": ["pkg/late.bin", "pkg/logo.png"]}
    assert sel.summary() == "2 documents (0.0 KiB of text); skipped 2 binary, 2 empty"
    # a hidden file named explicitly is read (it was asked for)
    assert D.read_documents([tmp_path / ".env"]) == [(".env", "SECRET=1\n")]


def test_include_and_exclude_globs_select_among_walked_files(tmp_path):
    _write(tmp_path, {"kdn/a.py": "a\n", "kdn/b.txt": "b\n", "kdn/sub/c.py": "c\n", "tests/test_a.py": "t\n",
                      "tests/data/d.py": "d\n", "docs/api/x.md": "x\n", "setup.py": "s\n",
                      "kdn/test_util.py": "u\n"})

    def names(**kw):
        return [n for n, _ in D.read_documents([tmp_path], **kw)]
    assert names(include=["*.py"]) == ["kdn/a.py", "kdn/sub/c.py", "kdn/test_util.py", "setup.py",
                                       "tests/data/d.py", "tests/test_a.py"]
    assert names(include=["*.py"], exclude=["tests/*"]) == ["kdn/a.py", "kdn/sub/c.py", "kdn/test_util.py", "setup.py"]
    assert names(include=["*.py"], exclude=["tests", "test_*"]) == ["kdn/a.py", "kdn/sub/c.py", "setup.py"]
    assert names(include=["kdn/*.py", "*.md"]) == ["docs/api/x.md", "kdn/a.py", "kdn/sub/c.py", "kdn/test_util.py"]
    assert names(include=["docs/api"]) == ["docs/api/x.md"]
    assert names(exclude=["./kdn/", "docs"]) == ["setup.py", "tests/data/d.py", "tests/test_a.py"]
    with pytest.raises(BadRequest, match=r"nothing to publish: no text file in .* --include '\*\.go' \(skipped no files"):
        names(include=["*.go"])
    with pytest.raises(BadRequest, match="no folder is given"):
        D.read_documents([tmp_path / "setup.py"], include=["*.py"])
    with pytest.raises(BadRequest, match="a glob must be a non-empty str"):
        names(exclude=["/"])


def test_the_order_is_sorted_and_the_same_for_the_same_tree(tmp_path):
    files = {f"m{i % 3}/f{(7 * i) % 10}.py": f"v = {i}\n" for i in range(10)}
    one, two = tmp_path / "one", tmp_path / "two"
    _write(one, files)
    _write(two, dict(reversed(list(files.items()))))      # created in the other order
    a, b = D.read_documents([one]), D.read_documents([two])
    assert a == b and [n for n, _ in a] == sorted(files, key=lambda n: n.split("/"))


def test_symlinks_never_lead_out_of_the_tree(tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text("SECRET = 1\n")
    tree = tmp_path / "tree"
    _write(tree, {"real.py": "R = 1\n", "sub/deep.py": "D = 1\n"})
    (tree / "inside-link.py").symlink_to(tree / "real.py")
    (tree / "out-link.py").symlink_to(outside)
    (tree / "loop").symlink_to(tree, target_is_directory=True)     # a folder link: never followed
    (tree / "dangling.py").symlink_to(tmp_path / "gone.py")
    os.mkfifo(tree / "pipe")                                        # reading it would block forever
    sel = D.select_documents([tree])
    assert sel.documents == [("inside-link.py", "R = 1\n"), ("real.py", "R = 1\n"), ("sub/deep.py", "D = 1\n")]
    assert sel.skipped["symlink"] == ["dangling.py", "loop", "out-link.py"]
    assert sel.skipped["not a regular file"] == ["pipe"]
    assert "SECRET" not in "".join(t for _, t in sel.documents)
    with pytest.raises(BadRequest, match="pipe: not a regular file or folder"):
        D.read_documents([tree / "pipe"])


def test_an_empty_selection_says_what_was_skipped(tmp_path):
    _write(tmp_path, {"a.png": b"\x89PNG" + bytes(8), "b/__init__.py": "", ".git/HEAD": "ref\n"})
    with pytest.raises(BadRequest) as e:
        D.read_documents([tmp_path])
    msg = str(e.value)
    assert msg.startswith(f"nothing to publish: no text file in {tmp_path}") and "1 binary: a.png" in msg
    assert "1 empty: b/__init__.py" in msg and "hidden entries" in msg
    with pytest.raises(BadRequest, match="give at least one file or folder"):
        D.read_documents([])
    with pytest.raises(BadRequest, match=r"missing\.md: no such file or folder"):
        D.read_documents([tmp_path / "missing.md"])
    (tmp_path / "empty.md").write_text("  \n")
    with pytest.raises(BadRequest, match=r"empty\.md: the document is empty"):
        D.read_documents([tmp_path / "empty.md"])


def test_sizes_are_bounded_before_any_file_is_read_whole(tmp_path):
    big = tmp_path / "tree" / "big.log"
    big.parent.mkdir()
    with open(big, "wb") as f:                 # sparse, all text-looking ('\0' is only sniffed
        f.write(b"log line\n" * 1000)          # in the first bytes; the file is never read whole)
        f.truncate(D.MAX_KB_BYTES + 1)
    t0 = time.perf_counter()
    with pytest.raises(BadRequest, match=rf"the documents reach {D.MAX_KB_BYTES + 1} bytes, over the "
                                         rf"{D.MAX_KB_BYTES}-byte limit of one knowledge base; largest: .*big\.log"):
        D.read_documents([big.parent])
    with pytest.raises(BadRequest, match=rf"big\.log: {D.MAX_KB_BYTES + 1} bytes, over the"):
        D.read_documents([big])
    half = tmp_path / "half.txt"
    with open(half, "wb") as f:
        f.write(b"text\n" * 2000)
        f.truncate(D.MAX_KB_BYTES // 2 + 1)
    twin = tmp_path / "sub" / "half.txt"
    twin.parent.mkdir()
    os.link(half, twin)
    with pytest.raises(BadRequest, match="over the .*-byte limit"):
        D.read_documents([half, twin])         # each fits; together they do not
    assert time.perf_counter() - t0 < 1.0
    # excluded files are never read or counted
    (big.parent / "ok.md").write_text("fine\n")
    assert D.read_documents([big.parent], exclude=["*.log"]) == [("ok.md", "fine\n")]


def test_names_that_cannot_be_document_names_are_refused(tmp_path):
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / os.fsdecode(b"caf\xe9.txt")).write_text("x\n")
    with pytest.raises(BadRequest, match="the file's name is not UTF-8"):
        D.read_documents([tree])


@pytest.mark.parametrize("bad, code", [("notes\nINFO forged.md", "U+000A"), ("a\rb.md", "U+000D"),
                                       ("a\tb.md", "U+0009"), ("invoice\u202efdp.md", "U+202E"),
                                       ("x\u2067y.md", "U+2067"), ("x\u200e.md", "U+200E")])
def test_names_with_control_or_bidirectional_characters_are_refused(tmp_path, bad, code):
    """Refused before anything is published, whether named, walked or given in Python: the
    error names the document (escaped) and the character by code point."""
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "fine.md").write_text("ok\n")
    (tree / bad).write_text("x\n")
    for paths in ([tree], [tree / bad]):
        with pytest.raises(BadRequest) as e:
            D.read_documents(paths)
        msg = str(e.value)
        assert f"the document name {bad!r} holds {code} (" in msg and "rename it or exclude it" in msg
        assert "\n" not in msg and "\r" not in msg and "\u202e" not in msg, "the message is escaped"
    assert D.read_documents([tree], exclude=[bad]) == [("fine.md", "ok\n")]
    with pytest.raises(BadRequest) as e:
        D.check_documents([("fine.md", "ok"), (bad, "x")])
    assert str(e.value).startswith(f"documents[1] name {bad!r} holds {code} (")


def test_a_path_named_twice_counts_its_skipped_entries_once(tmp_path):
    """The same folder twice, a folder and a file inside it, a folder and a folder inside
    it: each file is read once and each skipped entry counted once."""
    _write(tmp_path, {"pkg/a.py": "A = 1\n", "pkg/__init__.py": "", "pkg/logo.png": b"\x89PNG" + bytes(8),
                      "pkg/sub/b.py": "B = 1\n", "pkg/sub/c.bin": b"\0\1"})
    (tmp_path / "pkg" / "gone.py").symlink_to(tmp_path / "missing.py")
    pkg = tmp_path / "pkg"
    once = D.select_documents([pkg])
    assert once.summary() == "2 documents (0.0 KiB of text); skipped 2 binary, 1 empty, 1 symlink"
    for paths in ([pkg, pkg], [pkg, str(pkg) + "/", pkg / ".." / "pkg"], [pkg, pkg / "sub"],
                  [pkg / "sub", pkg], [pkg, pkg / "a.py"]):
        sel = D.select_documents(paths)
        assert sorted(sel.documents) == sorted(once.documents) and sel.skipped == once.skipped, paths
        assert sel.summary() == once.summary()
    assert once.skipped == {"binary": ["logo.png", "sub/c.bin"], "empty": ["__init__.py"], "symlink": ["gone.py"]}
    # a file both walked and named is a named file: its problems are errors, not skips
    with pytest.raises(BadRequest, match=r"logo\.png: .*only text files can be published"):
        D.select_documents([pkg, pkg / "logo.png"])
    # two folders: skipped entries are named relative to the root, like documents
    two = D.select_documents([pkg / "sub", tmp_path / "pkg"])
    assert two.skipped["binary"] == ["logo.png", "sub/c.bin"]


def test_walked_names_are_valid_manifest_document_names(tmp_path):
    _write(tmp_path, {"pkg/sub dir/módulo.py": "x = 1\n", "pkg/a-b_c.d.txt": "y\n", "[weird] (name).md": "z\n"})
    docs = D.read_documents([tmp_path])
    m = Manifest.build("kb", "t", "fp", [(n, [i + 1, i + 2]) for i, (n, _) in enumerate(docs)])
    again = Manifest.from_bytes(m.to_bytes())
    assert [d.name for d in again.documents] == ["[weird] (name).md", "pkg/a-b_c.d.txt", "pkg/sub dir/módulo.py"]


def test_a_bom_is_not_content():
    assert D.binary_reason("\ufeffx".encode()) is None


def test_this_repositorys_placement_folder_reads_as_its_modules():
    sel = D.select_documents([REPO / "kdn" / "placement"], include=["*.py"])
    names = [n for n, _ in sel.documents]
    assert names == ["__init__.py", "links.py", "replication.py", "ring.py", "sim.py", "topology.py"]
    assert dict(sel.documents)["ring.py"] == (REPO / "kdn" / "placement" / "ring.py").read_text()
    assert not sel.skipped.get("binary"), "__pycache__ is never walked"


# --- documents given in Python ---------------------------------------------------------------
def test_check_documents_refuses_what_a_manifest_would_refuse_after_the_prefill():
    assert D.check_documents([("a/x.py", "x"), ["b", "y"]]) == [("a/x.py", "x"), ("b", "y")]
    for docs, msg in (([], "at least one document"), ([("d", "  ")], "is empty"),
                      ([("d", b"bytes")], "pair of str"), (["text"], "pair of str"),
                      ([("", "t")], "name must be a non-empty str"), ([("a\0b", "t")], r"holds U\+0000 \(a control character\) at character 2"),
                      ([("x" * 1025, "t")], "at most 1024"),
                      ([("a.py", "t"), ("a.py", "u")], r"name 'a.py' is given twice")):
        with pytest.raises(BadRequest, match=msg):
            D.check_documents(docs)
    with pytest.raises(BadRequest, match="over the .*-byte limit"):
        D.check_documents([("a", "x" * (D.MAX_KB_BYTES // 2 + 1)), ("b", "y" * (D.MAX_KB_BYTES // 2))])


def test_join_documents_separates_documents_by_a_blank_line():
    text, spans = D.join_documents([("a", "one"), ("b", "two")])
    assert text == "one\n\ntwo" and spans == [("a", 0, 3), ("b", 5, 8)]


def test_kb_length_names_the_origins_limit_and_the_models_context():
    assert D.check_kb_tokens("kb", 4000, 8192) is None
    with pytest.raises(BadRequest) as e:
        D.check_kb_tokens("code", 25000, 8192)
    msg = str(e.value)
    assert "KB 'code' is 25000 tokens but the model's context is 8192 tokens (max_position_embeddings)" in msg
    assert f"up to {D.MAX_KB_TOKENS} tokens per KB" in msg and "no prompt could use it whole" in msg
    assert "several KBs" in msg and "kdn.engines.transformers.blend.publish_segments" in msg and "--allow-over-context" in msg
    warning = D.check_kb_tokens("code", 25000, 8192, allow_over_context=True)
    assert warning.startswith("warning: KB 'code' is 25000 tokens, longer than the model's context of 8192")
    with pytest.raises(BadRequest, match="vLLM's max_model_len") as e:     # no override there
        D.check_kb_tokens("code", 9000, 8192, allow_over_context=True, flag=None, context_name="vLLM's max_model_len")
    assert "--allow-over-context" not in str(e.value)
    with pytest.raises(BadRequest, match=f"over the origin's limit of {D.MAX_KB_TOKENS} tokens per KB"):
        D.check_kb_tokens("huge", D.MAX_KB_TOKENS + 1, 8192, allow_over_context=True)
    assert "7 are left for a question" in D.check_kb_tokens("kb", 8185, 8192)
