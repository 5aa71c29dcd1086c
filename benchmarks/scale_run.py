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
home: per-question entity linking, one-hop, GSRM and text search.

The data steps build everything (umls, dbt marts, corpus and mentions, qa items); the model steps run bounded
work whose size does not follow the release, so what grows in them is what the release makes them read: each
embedding table embeds one deterministic sample of about SAMPLE_ROWS rows (`EmbeddingConfig.sample`), the GAT
trains GAT_STEPS steps of the CPU profile over the whole graph (features of unsampled nodes are zeros), GSRM's
sweep and recall use GSRM_QUESTIONS validation questions (triples without a stored vector are encoded on the
fly and kept in the home's vector cache), and A2RAG without graph tokens answers EVAL_QUESTIONS kgqa_mc test
questions with the default LLM; the trainers (Graph-R1 SFT and GRPO, the reader adapter, the HIIM projector) run
a few steps, which measures what building their examples from a KG of this size costs. GPU-size GAT memory is
`gat_train.py --sizes`; encoder throughput `embed_throughput.py`.
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

from medgraph.methods.a2rag import A2RagConfig
from medgraph.settings import load_settings
from medgraph.tracking import CHAMPION, GAT_MODEL, Tracking

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
DG = str(Path(PYTHON).parent / "dg")

# Rows each embedding table's sample aims at (the sample is shard 0 of ceil(rows / this)).
SAMPLE_ROWS = {"node_embeddings": 2_000, "node_description_embeddings": 2_000, "edge_embeddings": 10_000,
               "chunk_embeddings": 1_000}
SAMPLE_SOURCES = {"node_embeddings": "kg.kg_node_text", "node_description_embeddings": "kg.kg_node_text",
                  "edge_embeddings": "kg.kg_edges", "chunk_embeddings": "text.corpus_chunks"}
# (step, asset selection, tables whose rows it reports, partition)
STEPS: tuple[tuple[str, str, tuple[str, ...], str | None], ...] = (
    ("umls", "group:umls", ("umls.mrconso", "umls.mrrel", "umls.mrsty", "umls.mrdef"), None),
    ("kg", "group:kg_staging or group:kg", ("kg.kg_nodes", "kg.kg_edges"), None),
    ("text", 'key:"text/corpus_chunks" or key:"kg/kg_chunk_mentions" or key:"kg/kg_chunk_links"',
     ("text.corpus_chunks", "kg.kg_chunk_mentions", "kg.kg_chunk_links"), None),
    ("qa", 'key:"qa/qa_items"', ("qa.qa_items",), None),
    # A bounded sample of each embedding table (EmbeddingConfig.sample): embedding every row is hours on 2 cores
    # (node texts ~40-80/s, triples ~250-420/s, benchmarks/README.md "embed_throughput.py"); the sample measures
    # the per-row cost and what grows with the table (its scan), and GSRM and the GAT run on what it leaves.
    ("embed", "group:embeddings", tuple(f"embeddings.{target}" for target in SAMPLE_SOURCES), None),
    ("gat", 'key:"models/gat_model"', (), None),
    ("gsrm", 'key:"models/gsrm_params" or key:"eval/gsrm_recall"', (), None),
    ("eval", 'key:"eval/qa_benchmark" or key:"eval/eval_a2rag"', (), "kgqa_mc"),
    # The trainers' data paths at size (their examples, trajectories and gates read the KG), for a few steps
    # (run_config): what the KG costs them, not what training costs (that is the GPU's, gpu_check.sh).
    ("graph_r1", 'key:"models/graph_r1_sft" or key:"models/graph_r1_policy"', (), None),
    ("reader", 'key:"models/reader_adapter"', (), None),
    ("hiim", 'key:"models/hiim_projector"', (), None),
)
GAT_STEPS = 20
GSRM_QUESTIONS = 4
TRAIN_STEPS = 2
EVAL_QUESTIONS = 4


def run_config(step: str, home: Path) -> dict | None:
    """The run config of a model step: bounded embedding samples, a fixed number of GAT steps on the CPU
    profile, GSRM's sweep and recall on a few questions, A2RAG (without graph tokens, the base reader) on a few
    kgqa_mc questions; the encoder in bfloat16 as the demo runs it. None for the data steps."""
    encoder = {"encoder": {"config": {"dtype": "bfloat16"}}}
    if step == "embed":
        rows = table_rows(home, tuple(SAMPLE_SOURCES.values()))
        shards = {target: max(1, math.ceil(rows.get(table, 0) / SAMPLE_ROWS[target]))
                  for target, table in SAMPLE_SOURCES.items()}
        return {"resources": encoder,
                "ops": {f"embeddings__{target}": {"config": {"sample": f"0/{n}"}} for target, n in shards.items()}}
    if step == "gat":
        gat = {"profile": "demo", "epochs": 1, "steps_per_epoch": GAT_STEPS}
        return {"ops": {"models__gat_model": {"config": gat}}}
    if step == "gsrm":
        # A2RAG's default tau and K only: the full sweep's tau 0.3 at K 3 reaches (and encodes) several times the
        # triples: 8 questions at 1M MRREL rows, vectors not stored, had not finished after 13 min.
        a2rag = A2RagConfig()
        sweep = {"limit": GSRM_QUESTIONS, "taus": [a2rag.tau], "iterations": list(range(a2rag.iterations + 1))}
        recall = {"limit": GSRM_QUESTIONS, "min_iterations": a2rag.iterations}
        return {"resources": encoder, "ops": {"models__gsrm_params": {"config": sweep},
                                              "eval__gsrm_recall": {"config": recall}}}
    if step == "eval":
        return {"resources": encoder, "ops": {
            "eval__qa_benchmark": {"config": {"limit": EVAL_QUESTIONS}},
            "eval__eval_a2rag": {"config": {"methods": ["a2rag-no-hiim"], "readers": ["base"]}}}}
    # Graph-R1 on the CPU profile with fewer steps: `tiny`'s 12 training questions and 48-token turns are made for
    # the test KG (at 1M rows they gave one demonstration, too long for the turn limit).
    graph_r1 = {"profile": "demo", "valid_items": EVAL_QUESTIONS, "steps": TRAIN_STEPS}
    tiny = {"profile": "tiny", "valid_items": EVAL_QUESTIONS}
    if step == "graph_r1":
        return {"resources": encoder, "ops": {"models__graph_r1_sft": {"config": {**graph_r1, "evaluate_base": False}},
                                              "models__graph_r1_policy": {"config": graph_r1}}}
    if step == "reader":
        return {"ops": {"models__reader_adapter": {"config": tiny}}}
    if step == "hiim":
        return {"resources": encoder, "ops": {"models__hiim_projector": {"config": tiny}}}
    return None


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


def evaluation_summary(home: Path) -> dict[str, float]:
    """Questions, accuracy and per-question latency of the newest A2RAG evaluation in the home."""
    summaries = sorted((home / "artifacts" / "eval_a2rag").glob("*/artifacts/summary_kgqa_mc.json"),
                       key=lambda path: path.stat().st_mtime)
    if not summaries:
        return {}
    (summary,) = json.loads(summaries[-1].read_text())["summaries"]
    return {key: round(summary[key], 3) for key in ("questions", "accuracy", "latency_p50_s", "latency_p95_s")}


def gat_champion_for_trainers(home: Path) -> str:
    """Make sure the home has a medgraph-gat champion before the HIIM step, which needs one.

    The scale run's GAT has features for a ~2k-node sample only (zeros elsewhere: 1.2% of the nodes have one at
    3M MRREL rows, 0.4% at 10M), so it cannot beat its untrained self and its gate rightly refuses it. The HIIM
    step measures what training the projector on a KG of this size costs, not the GAT, so here, and only here,
    the newest GAT version gets the alias, tagged as forced by the scale run. Returns what was done, for the
    step's row."""
    tracking = Tracking.from_settings(load_settings({"MEDGRAPH_HOME": str(home)}))
    if (version := tracking.champion_version(GAT_MODEL.name)) is not None:
        return f"gate v{version}"
    versions = tracking.client.search_model_versions(f"name = '{GAT_MODEL.name}'")
    if not versions:
        return "none"
    newest = max(versions, key=lambda v: int(v.version))
    tracking.client.set_registered_model_alias(GAT_MODEL.name, CHAMPION, newest.version)
    tracking.client.set_model_version_tag(GAT_MODEL.name, newest.version, "champion_forced_by",
                                          "benchmarks/scale_run.py")
    return f"forced v{newest.version}"


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
    for name, selection, tables, partition in STEPS:
        if only is not None and name not in only:
            continue
        command = [DG, "launch", "-m", "definitions", "--assets", selection]
        notes = {"gat_champion": gat_champion_for_trainers(home)} if name == "hiim" else {}
        if (config := run_config(name, home)) is not None:
            (base / f"{name}.config.json").write_text(json.dumps(config, indent=1))
            command += ["-c", str(base / f"{name}.config.json")]
        seconds, rss, rc = measured(command + (["--partition", partition] if partition else []), env,
                                    base / f"{name}.log")
        steps.append(Step(rows_in, name, seconds, rss, disk_mb(home),
                          {**table_rows(home, tables), **(evaluation_summary(home) if name == "eval" else {}), **notes},
                          rc))
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
                        "time_exponent": round(math.log(max(large.seconds, 1e-3) / max(small.seconds, 1e-3))
                                               / scale, 2),
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

    edges = {s.rows_in: s.rows.get("kg.kg_edges", 0) for s in steps if s.step == "kg" and s.returncode == 0}
    if not any(edges.values()):
        print("no plot: no size has a kg step to place it")
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(12.5, 4.6))
    colors = plt.get_cmap("tab20").colors
    for k, name in enumerate(dict.fromkeys(s.step for s in steps)):
        runs = [s for s in steps if s.step == name and s.returncode == 0 and edges.get(s.rows_in, 0) > 0]
        xs = [edges[s.rows_in] for s in runs]
        style = {"marker": "os^Dv"[k % 5], "color": colors[(2 * k) % 20 + (k >= 10)], "label": name}
        left.plot(xs, [s.seconds for s in runs], **style)
        right.plot(xs, [s.peak_rss_mb / 1024 for s in runs], **style)
    for axis, label in ((left, "wall time (s)"), (right, "peak RSS (GB)")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("kg_edges")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    right.axhline(8, color="red", linestyle="--", linewidth=1, label="8 GB target")
    right.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    figure.suptitle("Scale run: each asset step against the size of the KG (synthetic UMLS releases)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mrrel-rows", type=int, nargs="+", required=True)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "benchmarks" / "_work" / "scale_run")
    parser.add_argument("--only", help="comma-separated steps to run again in the homes of an earlier run "
                        f"({', '.join([*(name for name, *_ in STEPS), 'query'])}); their rows replace the "
                        "earlier ones in scale_run.json")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    steps = [step for rows_in in sorted(args.mrrel_rows) for step in run_size(rows_in, args.work_dir, only)]
    saved = args.work_dir / "scale_run.json"
    if only is not None and saved.exists():  # keep the earlier steps that were not run again
        fresh = {(s.rows_in, s.step) for s in steps}
        earlier = [Step(**row) for row in json.loads(saved.read_text())["steps"]]
        order = ["release", *(name for name, *_ in STEPS), "query"]
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
