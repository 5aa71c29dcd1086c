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


def _cmd_status(args: argparse.Namespace) -> int:
    """Where the platform's state is and what it holds (printed at the end of `make demo`)."""
    from medgraph.settings import load_settings
    from medgraph.storage import Lake, Warehouse

    settings = load_settings()
    warehouse = Warehouse(settings.warehouse_path, Lake(settings.lake_root))
    print(f"MEDGRAPH_HOME      {settings.home}")
    print(f"UMLS release       {settings.umls_dir or settings.sample_release_dir} "
          f"({'MEDGRAPH_UMLS_DIR' if settings.umls_dir else 'sample, profile ' + settings.profile})")
    print(f"warehouse          {warehouse.path}")
    if not warehouse.path.exists():
        print("                   (not built yet: run `make demo`)")
        return 1
    with warehouse.connect(read_only=True) as con:
        tables = con.execute(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_schema NOT IN ('information_schema', 'pg_catalog') AND table_schema NOT LIKE 'fts_%' "
            "ORDER BY 1, 2").fetchall()
        for schema, table in tables:
            rows = con.execute(f'SELECT count(*) FROM "{schema}"."{table}"').fetchone()[0]
            print(f"  {schema + '.' + table:<40}{rows:>12,} rows")
    print(f"lake               {settings.lake_root}")
    print(f"MLflow             {settings.mlflow_tracking_uri}")
    print("Dagster UI         make ui   (then open http://127.0.0.1:3000)")
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

    status = commands.add_parser("status", help="show where the state is (MEDGRAPH_HOME) and the tables it holds")
    status.set_defaults(handler=_cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `medgraph` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
