"""`kdn bench placement`: the placement simulator and the ring's figures (kdn.placement.sim).

Default: both; `--sim` the five-policy trace replay only, `--ring` the ring only (balance,
bounded loads, movement on join/leave, lookup speed); `--quick` a small run; `--json`
one JSON object last; `--plot PATH` the PNG (default ./kdn-placement.png).
"""
from kdn.bench import emit_json, table
from kdn.placement import sim


def main(argv=None):
    return sim.main(argv, table=table, emit_json=emit_json)
