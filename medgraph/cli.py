"""The `medgraph` command line: one `_cmd_<name>` function per subcommand.

To add a subcommand, write `_cmd_<name>(args) -> int` and register its parser
in `_parser()`; `main` dispatches on the `handler` default each subparser sets.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def _cmd_sample_release(args: argparse.Namespace) -> int:
    """Build the UMLS-format sample release and print what it holds."""
    from medgraph.umls.sample_release import build_sample_release

    summary = build_sample_release(args.out, profile=args.profile)
    for key, value in summary.as_metadata().items():
        print(f"{key}: {value}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medgraph", description="MedGraph: UMLS knowledge graph and GraphRAG.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sample = commands.add_parser(
        "sample-release", help="write a UMLS-format sample release built from HPO, ICD-10-CM and a drug table")
    sample.add_argument("--out", required=True, help="directory to write the RRF files into (replaced atomically)")
    sample.add_argument("--profile", choices=("tiny", "demo"), default="tiny",
                        help="tiny: ~2.7k concepts for tests; demo: ~50k concepts (default: tiny)")
    sample.set_defaults(handler=_cmd_sample_release)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `medgraph` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
