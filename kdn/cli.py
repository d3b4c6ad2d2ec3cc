"""The `kdn` command: launch and stop a network, publish and query knowledge, benchmarks.

Each subcommand is a thin shell over the Python API; errors KDN raises on purpose
(KDNError) print one line naming the problem and exit with status 2.
"""
import argparse
import importlib
import sys

from kdn.errors import KDNError


def _bench(args, rest):
    from kdn.bench import NAMES
    if args.name not in NAMES:
        raise KDNError(f"unknown benchmark {args.name!r}; choose one of: {', '.join(NAMES)}")
    mod = importlib.import_module(f"kdn.bench.{args.name}")
    return mod.main(rest) or 0


def build_parser():
    ap = argparse.ArgumentParser(prog="kdn", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="run a benchmark (kdn bench NAME --help)", add_help=False)
    b.add_argument("name")
    b.set_defaults(func=_bench, passthrough=True)
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest)
    except KDNError as e:
        print(f"kdn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
