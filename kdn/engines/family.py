"""Model families and recompute plans: when one model may read another model's KV, and how.

A model's fingerprint (kdn.engines.fingerprint) names its KV: exact KV is read only under an
equal fingerprint. Models with the same fields but the weights (architecture, layers, KV heads,
head dim, RoPE, KV dtype) form a family: a fine-tuned variant and its base, or two variants.
A member may opt in to reading another member's KV with a recompute plan (the DroidSpeak
idea, NSDI 2026): it takes the sender's KV for every layer but the plan's contiguous blocks
[start, end), and recomputes those layers itself, with its own weights, from the sender's hidden
states entering layer `start` (stored beside the sender's KV: `hidden_fingerprint`). The result
is never exact: it is flagged (exact=False, `cross_model`) and, where kept, kept under a
namespace that names the reader, the sender and the plan (`cross_fingerprint`), never under
either model's own.

A plan is chosen once per (reader, sender) pair on a calibration split (`choose`: the fewest
recomputed layers whose greedy answers agree with the reader's own on at least `target` of the
calibration questions) and stored with the pair (`save_plan`/`load_plan`: a JSON file under
the model cache, named by both fingerprints). The profile it was chosen on travels with it.
Where no plan reaches the target on calibration, the pair has no plan: its reader prefills
itself, as without this module.

This module is vocabulary (no torch): kdn.engines.transformers.crossmodel computes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

from kdn.core.errors import ModelError

FORMAT = 1


def family_fields(fields: dict) -> dict:
    """A model's fingerprint fields without its weights: what members of a family share."""
    return {k: v for k, v in fields.items() if k != "weights"}


def family_of(fields: dict) -> str:
    """xxh3-128 hex naming the family of a model with these fingerprint fields."""
    return xxhash.xxh3_128_hexdigest(json.dumps(family_fields(fields), sort_keys=True, default=str).encode())


def check_family(reader_fields: dict, sender_fields: dict) -> None:
    """ModelError naming the fields that differ, unless both models are of one family."""
    a, b = family_fields(reader_fields), family_fields(sender_fields)
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if differ:
        raise ModelError("the models are not of one family (they differ in "
                         + ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in differ)
                         + "): KV of one is meaningless to the other")


def hidden_fingerprint(sender: str, layer: int) -> str:
    """The fingerprint under which the hidden states of model `sender` entering `layer` are
    stored (a namespace of their own: they are not KV, and name the model that computed them)."""
    return f"hidden@{int(layer)}:{sender}"


@dataclass(frozen=True)
class Plan:
    """Reader `reader` takes sender `sender`'s KV and recomputes layers [start, end) of its
    `layers` from the sender's hidden states entering `start`. profile: per candidate plan
    tried on the calibration split, {"start", "end", "agree", "first", "items"}; calibration:
    what the split was (KBs and questions); target: the agreement the plan was chosen for."""
    reader: str
    sender: str
    start: int
    end: int
    layers: int
    target: float = 0.95
    calibration: dict = field(default_factory=dict)
    profile: tuple = ()

    def __post_init__(self):
        if not (0 <= self.start < self.end <= self.layers):
            raise ModelError(f"a plan recomputes layers [start, end) within 0..{self.layers}, got "
                             f"[{self.start}, {self.end})")
        if self.reader == self.sender:
            raise ModelError("a plan reads another model's KV: reader and sender are the same model")

    @property
    def recomputed(self) -> int:
        return self.end - self.start

    @property
    def name(self) -> str:
        """16 hex naming the plan: the pair and the layers recomputed."""
        return xxhash.xxh3_64_hexdigest(f"{self.reader}\0{self.sender}\0{self.start}\0{self.end}".encode())

    def describe(self) -> dict:
        """The `cross_model` field of an answer read with this plan."""
        return {"sender": self.sender, "plan": self.name, "recompute": [self.start, self.end],
                "layers": self.layers}

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self), "profile": [dict(p) for p in self.profile]}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ModelError(f"not a KDN recompute plan of format {FORMAT}: {str(d)[:80]!r}")
        try:
            return cls(reader=d["reader"], sender=d["sender"], start=int(d["start"]), end=int(d["end"]),
                       layers=int(d["layers"]), target=float(d["target"]), calibration=dict(d["calibration"]),
                       profile=tuple(d["profile"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"a recompute plan is missing or has a bad field ({e})") from None


def cross_fingerprint(plan: Plan) -> str:
    """The namespace fingerprint of KV a reader assembled with `plan`: it names the reader, the
    sender and the plan, so it never mixes with either model's exact KV."""
    return f"cross:{plan.reader}<-{plan.sender}:{plan.name}"


def choose(profile, reader: str, sender: str, layers: int, target: float = 0.95,
           calibration: dict = None) -> "Plan | None":
    """The plan of the fewest recomputed layers whose calibration agreement ("agree": the share of
    questions answered token-identically) is >= target; ties go to the higher agreement, then
    the later start. None when no candidate short of recomputing every layer reaches it (then
    reading across is no faster than the reader's own prefill)."""
    if not 0 < target <= 1:
        raise ModelError(f"target must be in (0, 1], got {target!r}")
    rows = [dict(p) for p in profile]
    ok = [p for p in rows if p["agree"] >= target and p["end"] - p["start"] < layers]
    if not ok:
        return None
    best = min(ok, key=lambda p: (p["end"] - p["start"], -p["agree"], -p["start"]))
    return Plan(reader=reader, sender=sender, start=best["start"], end=best["end"], layers=layers,
                target=target, calibration=dict(calibration or {}), profile=tuple(rows))


def plan_path(root: Path, reader: str, sender: str) -> Path:
    return Path(root) / "plans" / f"{reader}-from-{sender}.json"


def save_plan(plan: Plan, root: Path) -> Path:
    """Write the plan of its pair under root/plans (atomically: a reader never sees half a file)."""
    path = plan_path(root, plan.reader, plan.sender)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(plan.to_dict(), indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def load_plan(root: Path, reader: str, sender: str) -> Plan:
    """The stored plan of the pair, or ModelError saying how to make one."""
    path = plan_path(root, reader, sender)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"no recompute plan for reader {reader[:12]}… reading sender {sender[:12]}… "
                         f"(profile the pair first: `kdn model plan`)") from None
    except ValueError as e:
        raise ModelError(f"{path} is not a recompute plan ({e})") from None
    plan = Plan.from_dict(d)
    if (plan.reader, plan.sender) != (reader, sender):
        raise ModelError(f"{path} holds the plan of another pair")
    return plan
