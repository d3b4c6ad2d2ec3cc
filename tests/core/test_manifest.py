"""KB manifests: building from tokens, validation of every field, and the checksummed wire form."""
import dataclasses
import re

import numpy as np
import pytest

from kdn.core.errors import ManifestError
from kdn.core.keys import chunk_keys, namespace_digest
from kdn.core.manifest import LAYOUTS, Document, Manifest, check_name, token_digest

RNG = np.random.default_rng(7)
DOC_A = RNG.integers(0, 50_000, 600).astype(np.int64)
DOC_B = RNG.integers(0, 50_000, 100).astype(np.int64)


def build(layout="prefix", **kw):
    return Manifest.build("handbook", "acme", "llama-3-8b:abc123", [("a.md", DOC_A), ("b.md", DOC_B)],
                          layout=layout, **kw)


def test_prefix_layout_keys_are_the_chain_of_the_concatenation():
    m = build("prefix", meta={"pinned": ["eu-west"], "replicas": 3})
    ns = namespace_digest("acme", "llama-3-8b:abc123")
    assert m.ns == ns
    assert list(m.keys) == chunk_keys(np.concatenate([DOC_A, DOC_B]), ns)
    assert len(m.keys) == 3 and m.n_tokens == 700 and m.token_length() == 700
    a, b = m.documents
    assert (a.start, a.end, a.first_chunk, a.n_chunks) == (0, 600, 0, 3)
    assert (b.start, b.end, b.first_chunk, b.n_chunks) == (600, 700, 2, 1)   # shares chunk 2 with a
    assert a.digest == token_digest(DOC_A) and len(a.digest) == 32
    assert m.document_keys("b.md") == (m.keys[2],)
    assert m.version is None and m.label() == "acme/handbook@v?"


def test_segments_layout_keys_are_each_documents_own_chain():
    m = build("segments")
    ns = m.ns
    assert list(m.keys) == chunk_keys(DOC_A, ns) + chunk_keys(DOC_B, ns)
    a, b = m.documents
    assert (a.first_chunk, a.n_chunks, b.first_chunk, b.n_chunks) == (0, 3, 3, 1)
    assert (b.start, b.end) == (600, 700)
    assert m.document_keys("b.md") == tuple(chunk_keys(DOC_B, ns))
    assert m.token_length(["b.md"]) == 100


def test_roundtrip_bytes_and_dict():
    for layout in LAYOUTS:
        m = build(layout, meta={"ttl": 3600.0, "pinned": ["us"]}).with_version(4)
        back = Manifest.from_bytes(m.to_bytes())
        assert back == m and back.version == 4 and back.meta == {"ttl": 3600.0, "pinned": ["us"]}
        assert Manifest.from_dict(m.to_dict()) == m
        assert len({back, m}) == 1


def test_meta_is_copied_so_the_manifest_stays_frozen():
    meta = {"pinned": ["eu"]}
    m = build(meta=meta)
    meta["pinned"].append("us")
    assert m.meta == {"pinned": ["eu"]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.version = 3


def test_corrupt_bytes_are_detected():
    buf = bytearray(build().to_bytes())
    buf[len(buf) // 2] ^= 0x01
    with pytest.raises(ManifestError, match="manifest checksum mismatch: stored [0-9a-f]{16}, computed"):
        Manifest.from_bytes(bytes(buf))
    with pytest.raises(ManifestError, match="not a manifest: magic b'XXXX'"):
        Manifest.from_bytes(b"XXXX" + bytes(buf[4:]))
    with pytest.raises(ManifestError, match="truncated: 5 bytes"):
        Manifest.from_bytes(bytes(buf[:5]))
    wrong_fmt = bytes(buf[:4]) + b"\x09\x00" + bytes(buf[6:])
    with pytest.raises(ManifestError, match="format version 9 is not one this build reads"):
        Manifest.from_bytes(wrong_fmt)


@pytest.mark.parametrize("bad", ["", "..", "a/b", "a\\b", "a\0b", "-lead", ".hidden", "x" * 129,
                                 "a..b", "ok\n", 7, None])
def test_names_cannot_smuggle_paths(bad):
    with pytest.raises(ManifestError, match="manifest name must match"):
        dataclasses.replace(build(), name=bad)
    with pytest.raises(ManifestError, match="manifest tenant must match"):
        check_name(bad, "manifest tenant")


def test_good_names():
    for ok in ("a", "Handbook_v2.1-final", "x" * 128):
        assert check_name(ok, "manifest name") == ok


@pytest.mark.parametrize("bad, code", [("notes\nFAKE LOG LINE", "U+000A"), ("a\rb", "U+000D"),
                                       ("a\tb", "U+0009"), ("invoice\u202efdp.exe", "U+202E"),
                                       ("x\u2066y", "U+2066"), ("x\u200f", "U+200F"), ("x\u061c", "U+061C")])
def test_document_names_refuse_control_and_bidirectional_characters(bad, code):
    """Such a name would reach `kdn status`, logs and errors rewritten: refused when the
    manifest is built and when one is committed, naming the document and the character; a
    manifest stored before the rule is still read back (nothing already stored is harmed)."""
    with pytest.raises(ManifestError) as e:
        Manifest.build("kb", "t", "fp", [("ok.md", [1, 2, 3]), (bad, [4, 5])])
    assert str(e.value).startswith(f"document name {bad!r} holds {code} (")
    d = build().to_dict()
    d["documents"][0]["name"] = bad
    arrived = Manifest.from_dict(d)          # a stored one written before the rule still loads ...
    with pytest.raises(ManifestError, match=rf"document name .* holds {re.escape(code)} "):
        arrived.check_names()                # ... and a new one is refused at the origin's commit
    # KB names and tenants are plain words: refused too, and the message says which character
    for what in ("manifest name", "manifest tenant"):
        with pytest.raises(ManifestError, match=rf"{what} must match .* holds {re.escape(code)} "):
            check_name(f"kb{bad}", what)
    with pytest.raises(ManifestError, match=rf"manifest fingerprint .* holds {re.escape(code)} "):
        Manifest.build("kb", "t", f"fp{bad}", [("ok.md", [1, 2, 3])])
    assert Manifest.build("kb", "t", "fp", [("pkg/módulo 1.py", [1]), ("日本.md", [2])]).documents[1].name == "日本.md"


def mutated(**changes):
    d = build().to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, message", [
    (dict(version=0), "manifest version must be an int >= 1, got 0"),
    (dict(version="3"), "manifest version must be an int >= 1, got '3'"),
    (dict(version=True), "manifest version must be an int >= 1, got True"),
    (dict(layout="tree"), "manifest layout must be one of prefix, segments, got 'tree'"),
    (dict(chunk_tokens=0), r"manifest chunk_tokens must be an int in \[1, 1048576\], got 0"),
    (dict(n_tokens=-1), "manifest n_tokens must be an int >= 0, got -1"),
    (dict(fingerprint=""), "manifest fingerprint must be a non-empty str"),
    (dict(created=float("nan")), r"manifest created \(a time\) must be a number >= 0, got nan"),
    (dict(meta={"f": object()}), "manifest meta is not msgpack-able"),
    (dict(meta={1: "x"}), "manifest meta must be a dict with str keys"),
    (dict(meta={"big": "x" * 70_000}), "manifest meta is 700.. bytes packed, limit 65536"),
    (dict(keys="abc"), "manifest keys must be a list of 16-byte keys, got str"),
    (dict(n_tokens=650), "token range \\[600, 700\\) must lie in \\[600, 650\\]"),
    (dict(n_tokens=1000), "manifest has 3 keys; the prefix layout of 1000 tokens at 256 tokens per chunk has 4"),
    (dict(documents="doc"), "manifest documents must be a list, got str"),
    (dict(unknown=1), "manifest has unknown field\\(s\\): unknown"),
])
def test_invalid_fields_are_named(changes, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(mutated(**changes))


def test_missing_field_named():
    d = build().to_dict()
    del d["keys"]
    with pytest.raises(ManifestError, match="manifest is missing field\\(s\\): keys"):
        Manifest.from_dict(d)


def test_bad_key_length_names_its_index():
    d = build().to_dict()
    d["keys"] = list(d["keys"])
    d["keys"][1] = b"short"
    with pytest.raises(ManifestError, match=r"manifest keys\[1\] must be 16 bytes, got 5 bytes"):
        Manifest.from_dict(d)


def test_document_ranges_validated():
    base = build().to_dict()
    docs = base["documents"]
    bad_chunks = dict(docs[1], first_chunk=1)
    with pytest.raises(ManifestError, match=r"documents\[1\] \('b.md'\) chunk range first_chunk=1 n_chunks=1 "
                                            r"disagrees .* \(want first_chunk=2 n_chunks=1\)"):
        Manifest.from_dict(dict(base, documents=[docs[0], bad_chunks]))
    beyond = dict(docs[1], first_chunk=3)
    with pytest.raises(ManifestError, match=r"chunk range \[3, 4\) is beyond the 3 keys"):
        Manifest.from_dict(dict(base, documents=[docs[0], beyond]))
    with pytest.raises(ManifestError, match=r"documents\[1\] name 'a.md' is not unique"):
        Manifest.from_dict(dict(base, documents=[docs[0], dict(docs[1], name="a.md")]))
    overlapping = dict(docs[1], start=500)
    with pytest.raises(ManifestError, match=r"token range \[500, 700\) must lie in \[600, 700\]"):
        Manifest.from_dict(dict(base, documents=[docs[0], overlapping]))
    with pytest.raises(ManifestError, match="document 'b.md' end must be an int >= 600, got 10"):
        Manifest.from_dict(dict(base, documents=[docs[0], dict(docs[1], end=10)]))
    with pytest.raises(ManifestError, match="document 'b.md' digest must be lowercase hex"):
        Manifest.from_dict(dict(base, documents=[docs[0], dict(docs[1], digest="XYZ")]))
    with pytest.raises(ManifestError, match=r"document 'b.md': missing field\(s\) \['digest'\]"):
        d = dict(docs[1]); del d["digest"]
        Manifest.from_dict(dict(base, documents=[docs[0], d]))


def test_segments_must_cover_n_tokens():
    d = build("segments").to_dict()
    d["n_tokens"] = 800
    with pytest.raises(ManifestError, match="segments documents must be contiguous from 0 and cover it exactly \\(they cover 700\\)"):
        Manifest.from_dict(d)


def test_build_rejects_bad_tokens_and_layout():
    with pytest.raises(ManifestError, match="cannot build manifest 'kb': token ids must be >= 0"):
        Manifest.build("kb", "acme", "fp", [("d", [1, -2])])
    with pytest.raises(ManifestError, match="layout must be one of prefix, segments, got 'x'"):
        Manifest.build("kb", "acme", "fp", [("d", [1])], layout="x")


def test_empty_and_exact_multiple_edges():
    m = Manifest.build("kb", "acme", "fp", [("empty", []), ("full", list(range(512)))])
    assert m.n_tokens == 512 and len(m.keys) == 2
    assert [(d.first_chunk, d.n_chunks) for d in m.documents] == [(0, 0), (0, 2)]
    s = Manifest.build("kb", "acme", "fp", [("empty", []), ("full", list(range(512)))], layout="segments")
    assert [(d.first_chunk, d.n_chunks) for d in s.documents] == [(0, 0), (0, 2)]
    assert Manifest.from_bytes(s.to_bytes()) == s
    nothing = Manifest.build("kb", "acme", "fp", [])
    assert nothing.keys == () and nothing.n_tokens == 0 and Manifest.from_bytes(nothing.to_bytes()) == nothing


def test_document_lookup_error():
    with pytest.raises(ManifestError, match="KB 'handbook' has no document 'zz'"):
        build().document("zz")
    assert isinstance(build().documents[0], Document)
