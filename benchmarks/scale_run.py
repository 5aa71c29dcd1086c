"""A scale run anyone can repeat (issue 27): synthetic UMLS releases of given sizes, every CPU data asset
materialized in a fresh home, one measured step per asset group.

    .venv/bin/python benchmarks/scale_run.py --mrrel-rows 1000000 2000000 --work-dir /tmp/scale

For each size: writes `write_synthetic_release(<work-dir>/r<rows>/release, rows)`, then runs each step as
its own child process (`dg launch -m definitions --assets ...` with MEDGRAPH_PROFILE=full, MEDGRAPH_UMLS_DIR
and a fresh MEDGRAPH_HOME) and records its wall time, the child's peak RSS (`os.wait4`'s ru_maxrss), the
home's size on disk after it and the rows of the tables it wrote. Prints one table per size, the growth
exponent of time and memory between consecutive sizes (log ratio over log ratio of rows: 1.0 is linear),
and writes everything to <work-dir>/scale_run.json, with a least-squares projection of each step to a full
UMLS release (54M kg_edges) and a log-log plot (<work-dir>/scale_run.png). Last, `query_latency.py` in the
home: per-question entity linking, one-hop, GSRM and text search. Embeddings and the GPU assets are not
steps: GAT memory against graph size is `gat_train.py --sizes`, encoder throughput `embed_throughput.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
DG = str(Path(PYTHON).parent / "dg")

# (step, asset selection, tables whose rows it reports)
STEPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("umls", "group:umls", ("umls.mrconso", "umls.mrrel", "umls.mrsty", "umls.mrdef")),
    ("kg", "group:kg_staging or group:kg", ("kg.kg_nodes", "kg.kg_edges")),
    ("text", 'key:"text/corpus_chunks" or key:"kg/kg_chunk_mentions" or key:"kg/kg_chunk_links"',
     ("text.corpus_chunks", "kg.kg_chunk_mentions", "kg.kg_chunk_links")),
    ("qa", 'key:"qa/qa_items"', ("qa.qa_items",)),
)


@dataclass
class Step:
    rows_in: int  # MRREL rows of the release
    step: str
    seconds: float
    peak_rss_mb: float
    disk_mb: float
    rows: dict[str, int]
    returncode: int


def measured(command: list[str], env: dict[str, str], log: Path) -> tuple[float, float, int]:
    """Run `command` as a child; its wall seconds, peak RSS (MB, the child's own and its children's) and rc."""
    started = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss of wait4 is the largest of the child and its waited-for descendants (KiB on Linux).
    return time.perf_counter() - started, usage.ru_maxrss / 1024, child.returncode


def disk_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20 if path.exists() else 0.0


def table_rows(home: Path, tables: tuple[str, ...]) -> dict[str, int]:
    rows = {}
    warehouse = home / "warehouse.duckdb"
    if not warehouse.exists():
        return rows
    with duckdb.connect(str(warehouse), read_only=True) as con:
        for table in tables:
            try:
                rows[table] = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            except duckdb.Error:
                rows[table] = -1  # not built
    return rows


def run_size(rows_in: int, workdir: Path, only: set[str] | None = None) -> list[Step]:
    """Every step at one size in a fresh home; with `only`, just those steps in the home an earlier run left."""
    base = workdir / f"r{rows_in}"
    release, home = base / "release", base / "home"
    env = {**os.environ, "MEDGRAPH_HOME": str(home), "MEDGRAPH_UMLS_DIR": str(release), "MEDGRAPH_PROFILE": "full"}
    steps = []
    if only is None:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        seconds, rss, rc = measured(
            [PYTHON, "-c", (f"from medgraph.umls.synthetic import write_synthetic_release as w; "
                            f"w({str(release)!r}, {rows_in})")], env, base / "release.log")
        steps.append(Step(rows_in, "release", seconds, rss, disk_mb(release), {}, rc))
    elif not home.exists():
        raise SystemExit(f"--only needs the home of an earlier run at {home}")
    for name, selection, tables in STEPS:
        if only is not None and name not in only:
            continue
        seconds, rss, rc = measured([DG, "launch", "-m", "definitions", "--assets", selection], env,
                                    base / f"{name}.log")
        steps.append(Step(rows_in, name, seconds, rss, disk_mb(home), table_rows(home, tables), rc))
        print(f"{rows_in:>11,} {name:<8} {seconds:8.1f}s {rss:8.0f} MB  disk {steps[-1].disk_mb:8.0f} MB  rc {rc}  "
              f"{steps[-1].rows}", flush=True)
        if rc != 0:
            print(f"  step {name} failed: see {base / f'{name}.log'}", flush=True)
    if only is not None and "query" not in only:
        return steps
    # Query time at this size: entity linking, one-hop (the CSR index is built here), GSRM, text search.
    latency = base / "query_latency.json"
    seconds, rss, rc = measured([PYTHON, str(ROOT / "benchmarks" / "query_latency.py"), "--questions", "10",
                                 "--json", str(latency)], env, base / "query.log")
    stages = json.loads(latency.read_text())["stages"] if rc == 0 and latency.exists() else {}
    steps.append(Step(rows_in, "query", seconds, rss, disk_mb(home),
                      {f"{stage}_p50_ms": round(v["p50_ms"]) for stage, v in stages.items()}, rc))
    print(f"{rows_in:>11,} query    {seconds:8.1f}s {rss:8.0f} MB  rc {rc}  {stages}", flush=True)
    return steps


def exponents(steps: list[Step]) -> list[dict[str, object]]:
    """Growth exponent of seconds and peak RSS between consecutive sizes, per step."""
    by_step: dict[str, list[Step]] = {}
    for step in steps:
        by_step.setdefault(step.step, []).append(step)
    out = []
    for name, runs in by_step.items():
        for small, large in itertools.pairwise(runs):
            scale = math.log(large.rows_in / small.rows_in)
            out.append({"step": name, "from": small.rows_in, "to": large.rows_in,
                        "time_exponent": round(math.log(max(large.seconds, 1e-3) / max(small.seconds, 1e-3)) / scale, 2),
                        "rss_exponent": round(math.log(large.peak_rss_mb / small.peak_rss_mb) / scale, 2)})
    return out


UMLS_TRIPLES = 54_000_000  # kg_edges of a full UMLS release (the A2RAG paper's KG)


def projections(steps: list[Step]) -> list[dict[str, object]]:
    """Each step's time and peak RSS projected to a full UMLS release, by a least-squares line through
    log(value) against log(kg_edges) over the measured sizes (kg_edges from the kg step of each size)."""
    edges = {s.rows_in: s.rows.get("kg.kg_edges", 0) for s in steps if s.step == "kg" and s.returncode == 0}
    out = []
    for name in dict.fromkeys(s.step for s in steps):
        runs = [s for s in steps if s.step == name and s.returncode == 0 and edges.get(s.rows_in, 0) > 0]
        if len(runs) < 2 or name == "query":  # its wall time is mostly encoding triples the cache lacked
            continue
        xs = [math.log(edges[s.rows_in]) for s in runs]
        row: dict[str, object] = {"step": name}
        for field in ("seconds", "peak_rss_mb"):
            ys = [math.log(max(getattr(s, field), 1e-3)) for s in runs]
            mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
            row[f"{field}_exponent"] = round(slope, 2)
            row[f"{field}_at_umls"] = round(math.exp(mean_y + slope * (math.log(UMLS_TRIPLES) - mean_x)), 1)
        out.append(row)
    return out


def plot(steps: list[Step], path: Path) -> None:
    """Log-log plot of each step's wall time and peak RSS against the kg_edges of its size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = {s.rows_in: s.rows.get("kg.kg_edges", 0) for s in steps if s.step == "kg"}
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(s.step for s in steps):
        runs = [s for s in steps if s.step == name and s.returncode == 0 and edges.get(s.rows_in, 0) > 0]
        xs = [edges[s.rows_in] for s in runs]
        left.plot(xs, [s.seconds for s in runs], marker="o", label=name)
        right.plot(xs, [s.peak_rss_mb / 1024 for s in runs], marker="o", label=name)
    for axis, label in ((left, "wall time (s)"), (right, "peak RSS (GB)")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("kg_edges")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    right.axhline(8, color="red", linestyle="--", linewidth=1, label="8 GB target")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    figure.suptitle("Scale run: each asset step against the size of the KG (synthetic UMLS releases)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mrrel-rows", type=int, nargs="+", required=True)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "benchmarks" / "_work" / "scale_run")
    parser.add_argument("--only", help="comma-separated steps to run again in the homes of an earlier run "
                        f"({', '.join([*(name for name, _, _ in STEPS), 'query'])}); their rows replace the "
                        "earlier ones in scale_run.json")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    steps = [step for rows_in in sorted(args.mrrel_rows) for step in run_size(rows_in, args.work_dir, only)]
    saved = args.work_dir / "scale_run.json"
    if only is not None and saved.exists():  # keep the earlier steps that were not run again
        fresh = {(s.rows_in, s.step) for s in steps}
        earlier = [Step(**row) for row in json.loads(saved.read_text())["steps"]]
        order = ["release", *(name for name, _, _ in STEPS), "query"]
        steps = sorted([s for s in earlier if (s.rows_in, s.step) not in fresh] + steps,
                       key=lambda s: (s.rows_in, order.index(s.step)))
    growth = exponents(steps)
    for row in growth:
        print(f"{row['step']:<8} {row['from']:,} -> {row['to']:,}: time x^{row['time_exponent']}, "
              f"peak RSS x^{row['rss_exponent']}")
    projected = projections(steps)
    for row in projected:
        print(f"{row['step']:<8} at {UMLS_TRIPLES:,} kg_edges: ~{row['seconds_at_umls']:,.0f} s "
              f"(x^{row['seconds_exponent']}), ~{row['peak_rss_mb_at_umls']:,.0f} MB (x^{row['peak_rss_mb_exponent']})")
    (args.work_dir / "scale_run.json").write_text(json.dumps(
        {"steps": [asdict(s) for s in steps], "growth": growth, "projection": projected}, indent=1))
    plot(steps, args.work_dir / "scale_run.png")
    print(f"plot: {args.work_dir / 'scale_run.png'}")


if __name__ == "__main__":
    main()
