"""Emphasis weights: an operator's {document: integer weight} for a KB, checked.

The setting that kdn.engines.emphasis turns into edited KV (a weight k adds log k to the
document's attention logits). Publishers, the origin (a KB's emphasis override, like its pin
or TTL), the service (per request) and the CLI check weights here, so each refuses the same
values with the same message before anything changes. A weight of 1 is no edit and is dropped:
{} means "the KB's exact KV".
"""
from kdn.core.checks import check_int
from kdn.core.errors import BadRequest

MAX_EMPHASIS = 16               # each copy costs a token of cache; beyond ~16 the bias is +2.8 nats


def check_weights(weights, names=None) -> dict:
    """{document name: int weight} (weight-1 entries dropped), checked against the KB's document
    names (None: names unchecked): BadRequest naming the document for an unknown name or a
    weight that is not an int in [1, MAX_EMPHASIS]."""
    if weights is None:
        return {}
    if not isinstance(weights, dict):
        raise BadRequest(f"emphasis must be an object {{document name: integer weight}}, got "
                         f"{type(weights).__name__}")
    names = None if names is None else list(names)
    out = {}
    for name, w in weights.items():
        if not isinstance(name, str) or not name:
            raise BadRequest(f"emphasis keys must be document names, got {name!r:.80}")
        if names is not None and name not in names:
            raise BadRequest(f"emphasis names document {str(name)!r:.200}, which the knowledge base does "
                             f"not have (it has: {', '.join(repr(n) for n in names[:20])})")
        if isinstance(w, float) and w.is_integer():
            w = int(w)
        check_int(w, f"emphasis weight of document {name!r:.200}", 1, MAX_EMPHASIS,
                  note="a weight k adds log k to its tokens' attention logits")
        if w != 1:
            out[name] = w
    return out


def parse_weights(items) -> dict:
    """{name: int} from CLI items 'doc.md=4' (BadRequest naming a malformed one)."""
    out = {}
    for item in items or ():
        name, eq, value = str(item).rpartition("=")
        try:
            out[name] = int(value)
        except ValueError:
            raise BadRequest(f"--emphasis {item!r}: expected DOCUMENT=INTEGER, e.g. policy.md=4") from None
        if not eq or not name:
            raise BadRequest(f"--emphasis {item!r}: expected DOCUMENT=INTEGER, e.g. policy.md=4")
    return out


OVERRIDE_META = "emphasis_override"   # the meta key a listed manifest carries its KB's override under


def override_of(manifest) -> dict:
    """The emphasis an operator set on this manifest's KB (the origin adds it to the manifests it
    lists, under OVERRIDE_META; {} where none is set), kept to the documents this version has:
    an override outlives versions, and a later version may have dropped a document."""
    w = manifest.meta.get(OVERRIDE_META) or {}
    names = {d.name for d in manifest.documents}
    return {n: k for n, k in w.items() if n in names}
