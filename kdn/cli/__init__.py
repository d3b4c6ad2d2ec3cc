"""The `kdn` command: launch and stop a network, publish and query knowledge, benchmarks.

Each subcommand is a thin shell over the Python API. An error KDN raises on purpose
(KDNError, wherever in the network it was raised) prints one line naming the problem and
exits with status 2; an unexpected error inside a KDN node prints one line too (status 1).
No traceback and no terminal escape sequence from a remote message reaches the terminal.

One module per command group, each adding its subcommands (add_parsers):
- cluster.py        `kdn up`, `down`, `status`;
- service.py        `kdn serve`;
- kb.py             `kdn publish`, `query`, `emphasize`, `delete`, `collect`;
- conversations.py  `kdn conversations`;
- model.py          `kdn model variant`;
- common.py         what they share: the recorded network's client, its arguments, sizes;
- here              `kdn demo` (demo.py), `kdn bench NAME` (kdn.bench), and main: the errors.
"""
import argparse
import importlib
import re
import sys

from kdn.core.errors import KDNError
from kdn.engines.base import ENGINES

# CSI/OSC escape sequences, then any other control character (newlines included)
_ESCAPES = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])|[\x00-\x1f\x7f-\x9f]+")
MAX_ERROR_CHARS = 2000


def _bench(args, rest):
    from kdn.bench import NAMES
    if args.name not in NAMES:
        raise KDNError(f"unknown benchmark {args.name!r}; choose one of: {', '.join(NAMES)}")
    mod = importlib.import_module(f"kdn.bench.{args.name}")
    return mod.main(rest) or 0


def _demo(args, rest):
    from kdn.cli.demo import run
    run(questions_per_region=args.questions, max_new_tokens=args.max_new_tokens, engine=args.engine)
    return 0


def build_parser():
    from kdn.cli import cluster, conversations, kb, model, service
    ap = argparse.ArgumentParser(prog="kdn", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    cluster.add_parsers(sub)
    service.add_parsers(sub)
    kb.add_parsers(sub)
    conversations.add_parsers(sub)
    model.add_parsers(sub)
    _demo_args(sub)
    _bench_args(sub)
    return ap


def _demo_args(sub):
    dm = sub.add_parser("demo", help="start a local 3-region network, publish, query from every region, report")
    dm.add_argument("--questions", type=int, default=2, help="questions per region")
    dm.add_argument("--max-new-tokens", type=int, default=24)
    dm.add_argument("--engine", choices=ENGINES, default="transformers",
                    help="vllm: also a vLLM worker with the KDN connector, beside the transformers ones")
    dm.set_defaults(func=_demo)


def _bench_args(sub):
    b = sub.add_parser("bench", help="run a benchmark (kdn bench NAME --help)", add_help=False)
    b.add_argument("name")
    b.set_defaults(func=_bench, passthrough=True)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest)
    except KDNError as e:
        print(f"kdn: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except _ray_errors() as e:       # a bug in a node: its message, not Ray's remote traceback
        cause = getattr(e, "cause", None) or e
        print(f"kdn: error: unexpected {type(cause).__name__} in a KDN node: "
              f"{one_line(str(cause))}", file=sys.stderr)
        return 1


def one_line(message: str) -> str:
    """message as one printable line: escape sequences and control characters removed
    (a remote message must not drive the user's terminal), bounded in length."""
    text = " ".join(_ESCAPES.sub(" ", message).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


def _ray_errors() -> tuple:
    """Ray's error base when Ray is loaded (a command that never imported it raises none)."""
    ray = sys.modules.get("ray")
    return (ray.exceptions.RayError,) if ray is not None else ()
