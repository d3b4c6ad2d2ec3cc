"""Emphasis weights: an operator's {document: integer weight} for a KB, checked.

The setting that kdn.engines.kv_edit turns into edited KV (a weight k adds log k to the
document's attention logits). Publishers, the origin (a KB's emphasis override, like its pin
or TTL), the service (per request) and the CLI check weights here, so each refuses the same
values with the same message before anything changes. A weight of 1 is no edit and is dropped:
{} means "the KB's exact KV". One rule everywhere: a weight is an integer in [1, MAX_EMPHASIS],
and typed on a command line it is written in ASCII digits.

Emphasized copies. An edit of a KB version that an operator stores (kdn.engines.emphasis_variants) is
a manifest of the same KB name under a fingerprint derived from the model's,
"<model fingerprint>~emphasis-<32 hex>": its keys are its own, so no reader of the KB can name
them. Such a manifest is a copy that belongs to the KB version its meta names ("of"), never a
KB: `is_emphasized` is the one test of it, and every operator-facing listing and every "latest
version" lookup keeps only the manifests it is false for (`own_manifests`); retiring a KB
version retires its copies (`copies_of`).
"""
import re

from kdn.core.checks import check_int
from kdn.core.errors import BadRequest

MAX_EMPHASIS = 16               # each copy costs a token of cache; beyond ~16 the bias is +2.8 nats
WEIGHT_NOTE = "a weight k adds log k to its tokens' attention logits"
EMPHASIS_MARK = "~emphasis-"    # between a model's fingerprint and an edit's salt
_EMPHASIZED = re.compile(r"(.+)~emphasis-([0-9a-f]{32})", re.ASCII)
_ASCII_DIGITS = re.compile(r"0*[0-9]{1,9}", re.ASCII)   # a bounded int() of ASCII digits


def _weight(w, name):
    """w (an int in [1, MAX_EMPHASIS]; an integral float as its int), else the one message."""
    if isinstance(w, float) and w.is_integer():
        w = int(w)
    return check_int(w, f"emphasis weight of document {name!r:.200}", 1, MAX_EMPHASIS, note=WEIGHT_NOTE)


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
        w = _weight(w, name)
        if w != 1:
            out[name] = w
    return out


def parse_weights(items) -> dict:
    """{name: int} from command-line items 'doc.md=4' (the last '=' splits). BadRequest naming
    a malformed item, or a weight that is not an integer in [1, MAX_EMPHASIS] written in ASCII
    digits (the message check_weights gives: "٤", " 4", "+4", "4.0" and "1_0" are refused)."""
    out = {}
    for item in items or ():
        name, eq, value = str(item).rpartition("=")
        if not eq or not name:
            raise BadRequest(f"emphasis {str(item)!r:.200}: expected DOCUMENT=K (K an integer in "
                             f"[1, {MAX_EMPHASIS}]), e.g. policy.md=4")
        out[name] = parse_weight(value, name)
    return out


def parse_weight(text: str, document: str) -> int:
    """One weight typed on a command line: ASCII digits of an integer in [1, MAX_EMPHASIS], else
    BadRequest with the message check_weights gives (naming `document`)."""
    text = str(text)
    return _weight(int(text) if _ASCII_DIGITS.fullmatch(text) else text, document)


OVERRIDE_META = "emphasis_override"   # the meta key a listed manifest carries its KB's override under


def override_of(manifest) -> dict:
    """The emphasis an operator set on this manifest's KB (the origin adds it to the manifests it
    lists, under OVERRIDE_META; {} where none is set), kept to the documents this version has:
    an override outlives versions, and a later version may have dropped a document."""
    w = manifest.meta.get(OVERRIDE_META) or {}
    names = {d.name for d in manifest.documents}
    return {n: k for n, k in w.items() if n in names}


# --- emphasized copies (see the module) ----------------------------------------------------------
def emphasis_fingerprint(fingerprint: str, salt: bytes) -> str:
    """The fingerprint of an edit's namespace (salt: kdn.engines.kv_edit.edit_salt): never a
    model's own, and `is_emphasized` says so."""
    return f"{fingerprint}{EMPHASIS_MARK}{bytes(salt).hex()}"


def _fingerprint(m) -> str:
    """The fingerprint of a manifest, or m itself when it is one."""
    return m if isinstance(m, str) else m.fingerprint


def model_of(m) -> "str | None":
    """The model fingerprint an emphasized copy (its manifest, or its fingerprint) was edited
    from; None when it is a model's own (a KB's manifest)."""
    hit = _EMPHASIZED.fullmatch(_fingerprint(m))
    return hit.group(1) if hit else None


def is_emphasized(m) -> bool:
    """Whether a manifest or a fingerprint is an emphasized copy's, not a KB's: the one test
    every listing and lookup of KBs uses."""
    return model_of(m) is not None


def own_manifests(manifests) -> list:
    """The KBs' own manifests among `manifests`: emphasized copies left out."""
    return [m for m in manifests if not is_emphasized(m)]


def copy_of(m) -> "tuple | None":
    """(model fingerprint, KB name, KB version) an emphasized copy's manifest edits (from its
    meta "of"; None where it names none), None for a KB's own manifest."""
    fp = model_of(m)
    if fp is None:
        return None
    of = m.meta.get("of")
    of = of if isinstance(of, dict) else {}
    return fp, of.get("kb"), of.get("version")


def copies_of(manifests, kb) -> list:
    """The emphasized copies among `manifests` of the KB version whose manifest is `kb`: same
    tenant, derived from its model's fingerprint, naming its name and version."""
    want = (kb.fingerprint, kb.name, kb.version)
    return [m for m in manifests if m.tenant == kb.tenant and copy_of(m) == want]


def check_copy(manifest) -> None:
    """BadRequest unless a manifest under an emphasized fingerprint says which KB version it
    edits (meta "of": {"kb": its own name, "version": int}) and that it is inexact: what lets
    retiring that version retire it. A KB's own manifest passes."""
    of = copy_of(manifest)
    if of is None:
        return
    _, kb, version = of
    try:
        named = check_int(version, "the version an emphasized copy edits", 1) and kb == manifest.name
    except BadRequest:
        named = False
    if not named or manifest.meta.get("exact") is not False:
        raise BadRequest(f"{manifest.label()} is under an emphasized fingerprint ({EMPHASIS_MARK}...): "
                         f"its meta must name the version of {manifest.name!r} it edits ('of': "
                         f"{{'kb': {manifest.name!r}, 'version': N}}) and say 'exact': False")
