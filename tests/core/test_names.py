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
