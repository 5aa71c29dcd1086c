"""Do two MEDGRAPH_HOMEs hold the same results? For a change that must not change behaviour (a refactor).

Compares, apart from wall-clock values:
- every Parquet table of the two lakes, row for row after sorting (a release's timestamped file name is
  matched by table; vectors and lists compared exactly);
- the reports line by line (report.md; a line that differs only in clock cells is listed as such);
- every MLflow metric series, matched by experiment, metric key and step.

    .venv/bin/python benchmarks/compare_homes.py HOME_A HOME_B

Exit status 0 when tables and report agree outside clock cells (MLflow float differences are printed, not
fatal: they are reported so a reader can judge them).
"""

from __future__ import annotations

import argparse
import re
import sqlite3
from pathlib import Path

import pandas as pd

# Column names, metric keys and report headers that hold wall-clock measurements.
CLOCK = re.compile(r"latency|second|_s$|_ms$|wall|duration|per_s\b|tokens_per", re.IGNORECASE)
RELEASE_STAMP = re.compile(r"\.\d{8}T\d{6}-[0-9a-f]{8}")  # umls/<table>.<timestamp>-<hash>.parquet
RUN_ID = re.compile(r"[0-9a-f]{8}(?:-[0-9a-f]{4}){0,4}[0-9a-f]*")


def lake_tables(home: Path) -> dict[str, Path]:
    lake = home / "lake"
    return {RELEASE_STAMP.sub("", p.relative_to(lake).as_posix()): p for p in sorted(lake.rglob("*.parquet"))}


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    """Clock columns dropped, array cells as their list text, rows sorted: equal frames compare equal."""
    kept = frame[[c for c in frame.columns if not CLOCK.search(c)]]
    text = kept.apply(lambda column: column.map(lambda v: repr(v.tolist() if hasattr(v, "tolist") else v)))
    return text.sort_values(list(text.columns)).reset_index(drop=True) if len(text.columns) else text


def compare_tables(a: Path, b: Path) -> list[str]:
    tables_a, tables_b = lake_tables(a), lake_tables(b)
    problems = [f"only in {home}: {name}" for home, names in ((a, tables_a.keys() - tables_b.keys()),
                                                               (b, tables_b.keys() - tables_a.keys()))
                for name in sorted(names)]
    for name in sorted(tables_a.keys() & tables_b.keys()):
        frame_a, frame_b = pd.read_parquet(tables_a[name]), pd.read_parquet(tables_b[name])
        if list(frame_a.columns) != list(frame_b.columns):
            problems.append(f"{name}: columns differ")
        elif not comparable(frame_a).equals(comparable(frame_b)):
            problems.append(f"{name}: rows differ ({len(frame_a)} vs {len(frame_b)} rows)")
        else:
            print(f"same  {name} ({len(frame_a)} rows)")
    return problems


def clock_columns(header: str) -> set[int]:
    cells = [c.strip() for c in header.strip("|").split("|")]
    return {i for i, cell in enumerate(cells) if re.search(r"\bp\d\d s\b|latency|seconds", cell, re.IGNORECASE)}


def compare_report(a: Path, b: Path) -> list[str]:
    """report.md line by line; within a table, cells under a clock header may differ."""
    lines_a = (a / "reports" / "report.md").read_text(encoding="utf-8").splitlines()
    lines_b = (b / "reports" / "report.md").read_text(encoding="utf-8").splitlines()
    if len(lines_a) != len(lines_b):
        return [f"report.md: {len(lines_a)} vs {len(lines_b)} lines"]
    problems, clock, clock_only = [], set(), 0
    for number, (line_a, line_b) in enumerate(zip(lines_a, lines_b, strict=True), start=1):
        if line_a.startswith("| ") and not line_a.startswith("|---"):
            if number < len(lines_a) and lines_a[number].startswith("|---"):
                clock = clock_columns(line_a)  # a table's header row
        elif not line_a.startswith("|"):
            clock = set()
        if line_a == line_b:
            continue
        cells_a, cells_b = line_a.strip("|").split("|"), line_b.strip("|").split("|")
        latency_claim = "latency" in line_a.lower() and "latency" in line_b.lower()
        differing = {i for i, (x, y) in enumerate(zip(cells_a, cells_b, strict=False)) if x != y}
        if len(cells_a) == len(cells_b) and (differing <= clock or latency_claim):
            clock_only += 1
        else:
            problems.append(f"report.md:{number}: {line_a[:160]!r} vs {line_b[:160]!r}")
    print(f"report.md: {len(lines_a)} lines, {clock_only} differ in clock cells only")
    return problems


def metric_series(home: Path) -> dict[tuple, list[float]]:
    with sqlite3.connect(home / "mlflow.db") as con:
        rows = con.execute("SELECT e.name, coalesce(r.name, ''), m.key, m.step, m.value FROM metrics m "
                           "JOIN runs r ON m.run_uuid = r.run_uuid "
                           "JOIN experiments e ON r.experiment_id = e.experiment_id").fetchall()
    series: dict[tuple, list[float]] = {}
    for experiment, run, key, step, value in rows:
        if not CLOCK.search(key):
            series.setdefault((experiment, RUN_ID.sub("#", run), key, step), []).append(value)
    return {k: sorted(v) for k, v in series.items()}


def compare_metrics(a: Path, b: Path) -> None:
    series_a, series_b = metric_series(a), metric_series(b)
    keys = series_a.keys() | series_b.keys()
    differing = sorted(k for k in keys if series_a.get(k) != series_b.get(k))
    print(f"MLflow: {len(keys)} metric series outside clock keys, {len(differing)} differ")
    for key in differing:
        print(f"  {key[0]} {key[2]} step {key[3]}: {series_a.get(key)} vs {series_b.get(key)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("home_a", type=Path)
    parser.add_argument("home_b", type=Path)
    args = parser.parse_args()
    problems = compare_tables(args.home_a, args.home_b) + compare_report(args.home_a, args.home_b)
    compare_metrics(args.home_a, args.home_b)
    for problem in problems:
        print("DIFFERS", problem)
    print("same results outside clock cells" if not problems else f"{len(problems)} differences")
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
