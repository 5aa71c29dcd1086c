"""Time and peak RSS of question generation and the shortcut measurement on an existing KG home.

    MEDGRAPH_HOME=... /usr/bin/time -v .venv/bin/python benchmarks/qa_generation.py [--per-type 1000]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

from medgraph.kg.shortcuts import check_shortcuts, measure_shortcuts
from medgraph.qa.generate import generate_qa_items
from medgraph.settings import load_settings
from medgraph.storage import open_warehouse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-type", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warehouse = open_warehouse(load_settings())
    started = time.perf_counter()
    stats = generate_qa_items(warehouse, tempfile.mkdtemp(prefix="qa_bench_"), seed=args.seed,
                              per_type=args.per_type)
    generated = time.perf_counter()
    rows = measure_shortcuts(warehouse)
    measured = time.perf_counter()
    print(json.dumps({
        "generate_s": round(generated - started, 2), "shortcuts_s": round(measured - generated, 2),
        "per_type": stats.per_type, "items": stats.items,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "shortcut_check": check_shortcuts(rows) or "passes",
        "test": {f"{r['dataset']}/{r['rule']}": round(r["accuracy"], 3) for r in rows if r["split"] == "test"},
    }, indent=1))


if __name__ == "__main__":
    main()
