"""Names every process agrees on: the Ray namespace, actor names, where a chunk came from.

The launcher (kdn.launch.cluster), the nodes (kdn.edge, kdn.origin) and the client all find each
other by these names, so they live here in the vocabulary rather than in any one of them:
the launcher imports the nodes, never the reverse.

Names people read too (document names, KB names, tenants) reach `kdn status`, logs and error
messages, so none may hold a character that rewrites what a terminal shows: a control
character (a newline forges a log line, an escape drives the terminal) or a line separator,
or a bidirectional control (U+202E shows the text after it reversed). `unsafe_char` finds
the first; the validators that own each name (kdn.core.manifest, kdn.client.documents) refuse it.
"""
import re
import unicodedata

NAMESPACE = "kdn"                # the Ray namespace every KDN actor is named in
MAX_NAME = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

# Where a served chunk came from (Fetched.sources, X-KDN-Sources): one of these, or PEER + edge.
# LOCAL: the serving edge's memory tiers; DISK: its disk tier (kdn/edge/disk.py), read for this
# reply; ORIGIN: pulled from the origin; PEER + edge: pulled from another edge.
LOCAL, DISK, ORIGIN, PEER = "local", "disk", "origin", "peer:"
SOURCE_KINDS = (LOCAL, DISK, "peer", ORIGIN)

# A node of a network, as calls name it (kdn.core.rpc.Actors, actor_name): an edge by its name,
# the origin by ORIGIN_NODE. None, not a string, so that no edge's name can ever mean the origin.
ORIGIN_NODE = None


# Unicode's bidirectional formatting controls: embeddings and overrides (U+202A-U+202E),
# isolates (U+2066-U+2069), and the marks (LRM U+200E, RLM U+200F, ALM U+061C)
BIDI_CONTROLS = frozenset([*map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A)),
                           "\u200e", "\u200f", "\u061c"])
UNSAFE_CATEGORIES = ("Cc", "Zl", "Zp")       # control characters, line and paragraph separators


def unsafe_char(value: str) -> "str | None":
    """The first character of value a name may not hold, described with its code point and
    position ('U+202E (RIGHT-TO-LEFT OVERRIDE, a bidirectional control) at character 3'),
    or None when there is none."""
    for i, ch in enumerate(value):
        cat = unicodedata.category(ch)
        if ch in BIDI_CONTROLS or cat in UNSAFE_CATEGORIES:
            kind = "a bidirectional control" if ch in BIDI_CONTROLS else \
                "a control character" if cat == "Cc" else "a line or paragraph separator"
            label = unicodedata.name(ch, "")
            return f"U+{ord(ch):04X} ({label + ', ' if label else ''}{kind}) at character {i + 1}"
    return None


def check_node_name(value, what: str = "edge name") -> str:
    """A network or edge name: letters, digits, '.', '_', '-' (it is part of actor names and
    of source strings, so ':' and '/' are refused)."""
    from kdn.core.errors import BadRequest
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not _NAME.fullmatch(value):
        raise BadRequest(f"{what} must be 1-{MAX_NAME} letters, digits, '.', '_' or '-' "
                         f"(starting with a letter or digit), got {value!r:.80}")
    return value


def origin_name(network: str) -> str:
    return f"{network}:origin"


def edge_actor_name(network: str, edge: str) -> str:
    return f"{network}:edge:{edge}"


def actor_name(network: str, node) -> str:
    """The Ray actor name of node in network: an edge's name, or ORIGIN_NODE."""
    return origin_name(network) if node is ORIGIN_NODE else edge_actor_name(network, node)


def peer_source(edge: str) -> str:
    return PEER + edge


def source_kind(source: str) -> str:
    """local, disk, peer or origin (SOURCE_KINDS)."""
    return "peer" if source.startswith(PEER) else source


def source_holder(source: str, edge: str) -> str:
    """The edge holding the copy a fetch through `edge` served from `source`."""
    return source[len(PEER):] if source.startswith(PEER) else edge
