"""Names every process agrees on (kdn/core/names.py): actor names and where a chunk came from."""
import pytest

from kdn.core import names
from kdn.core.errors import BadRequest


def test_actor_names_of_the_origin_and_an_edge():
    assert names.actor_name("kdn", names.ORIGIN_NODE) == names.origin_name("kdn") == "kdn:origin"
    assert names.actor_name("kdn", "eu-west-0") == names.edge_actor_name("kdn", "eu-west-0") \
        == "kdn:edge:eu-west-0"


def test_sources_name_their_kind_and_holder():
    src = names.peer_source("ap-south-1")
    assert src == "peer:ap-south-1"
    assert names.source_kind(src) == "peer" and names.source_holder(src, "us-east-0") == "ap-south-1"
    for s in (names.LOCAL, names.ORIGIN):
        assert names.source_kind(s) == s and names.source_holder(s, "us-east-0") == "us-east-0"


@pytest.mark.parametrize("bad", ["", "a:b", "a/b", " a", "-a", "x" * 65, None, 3])
def test_node_names_are_plain_words(bad):
    with pytest.raises(BadRequest, match="letters, digits"):
        names.check_node_name(bad, "network name")
    assert names.check_node_name("eu-west_0.a") == "eu-west_0.a"


@pytest.mark.parametrize("name, where, code", [
    ("a\nb", 2, "U+000A"), ("report\r.md", 7, "U+000D"), ("\tx", 1, "U+0009"), ("x\x1b[2J", 2, "U+001B"),
    ("a\x00", 2, "U+0000"), ("cod\u202egnp.exe", 4, "U+202E"), ("a\u202ab", 2, "U+202A"),
    ("\u2066x", 1, "U+2066"), ("x\u2069", 2, "U+2069"), ("x\u200e", 2, "U+200E"), ("x\u200f", 2, "U+200F"),
    ("x\u061c", 2, "U+061C"), ("x\x85", 2, "U+0085"), ("x\u2028y", 2, "U+2028"), ("x\u2029", 2, "U+2029"),
])
def test_names_may_not_hold_control_or_bidirectional_characters(name, where, code):
    why = names.unsafe_char(name)
    assert why.startswith(f"{code} (") and why.endswith(f") at character {where}")


def test_what_a_name_may_hold():
    for ok in ("a.md", "pkg/sub dir/módulo.py", "日本語.txt", "[weird] (name).md", "emoji 🙂.md", "a\u200db"):
        assert names.unsafe_char(ok) is None
    assert names.unsafe_char("cod\u202egnp.exe") == \
        "U+202E (RIGHT-TO-LEFT OVERRIDE, a bidirectional control) at character 4"
    assert names.unsafe_char("a\nb") == "U+000A (a control character) at character 2"
