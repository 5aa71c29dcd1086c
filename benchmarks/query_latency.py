"""Per-question latency of A2RAG's retrieval stages on an existing home (issue 27, item 5): what one
answer costs before the LLM, at the demo size and at a UMLS-like size.

    MEDGRAPH_HOME=<home> .venv/bin/python benchmarks/query_latency.py [--questions 50] [--split test]

One question at a time (a person asking `medgraph ask`), over the first `--questions` KG questions of the
split (kgqa_mc and kgqa_short alternately), after one warm-up question. Stages, each timed alone:
- `entity_linking`: the concepts the question and its options name (`KnowledgeTools.question_entities`:
  the dictionary matcher over every KG name, exact option names); the one-off dictionary build is printed
  apart (it is paid once per process);
- `one_hop`: the 1-hop triples of those concepts (the CSR index; its one-off load is printed apart);
- `gsrm_cold`: A2RAG's GSRM with default tau / K / N (query encoding, hops, triple scoring; triples
  missing from `embeddings.edge_embeddings` and from the home's vector cache are encoded on the fly and
  cached, as the evaluation does: `triples_encoded_on_the_fly` says how many); `gsrm_warm`: the same
  questions again once every triple they reach has a vector (a home whose edges are all embedded);
- `text_search`: hybrid BM25 + dense search of the corpus, when `embeddings.chunk_embeddings` exists.
Prints p50 / p95 / max per stage, the home's sizes and the process peak RSS; `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

from medgraph.embed.encoder import load_encoder
from medgraph.methods.a2rag import A2RagConfig, gsrm_items
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.table import load_qa_items
from medgraph.retrieval import Retriever
from medgraph.settings import load_settings
from medgraph.storage import open_warehouse


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--split", default="test")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--dtype", default="bfloat16", help="the encoder's dtype (the demo's: its stored vectors "
                        "and the vector cache are found under the encoder id, which includes it)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    warehouse = open_warehouse(load_settings())
    mc = [i for i in load_qa_items(warehouse, args.split) if i.dataset == "kgqa_mc"]
    short = [i for i in load_qa_items(warehouse, args.split) if i.dataset == "kgqa_short"]
    items = [item for pair in zip(mc, short) for item in pair][: args.questions + 1]
    if len(items) < 2:
        raise SystemExit(f"{args.split}: fewer than 2 kgqa_mc/kgqa_short questions in qa.qa_items")
    sizes = {table: warehouse.count(table) for table in ("kg.kg_nodes", "kg.kg_edges")}
    with Retriever(warehouse, load_encoder(args.encoder, dtype=args.dtype)) as retriever:
        # As the evaluation does: triple vectors missing from edge_embeddings persist in the home's vector cache.
        tools = KnowledgeTools.with_home_cache(retriever, load_settings().home)
        config = A2RagConfig()
        started = time.perf_counter()
        _ = tools.dictionary
        one_off = {"dictionary_build_s": time.perf_counter() - started}
        started = time.perf_counter()
        _ = retriever.graph.index
        one_off["graph_index_load_s"] = time.perf_counter() - started
        has_chunks = warehouse.exists("embeddings", "chunk_embeddings")
        timings: dict[str, list[float]] = {"entity_linking": [], "one_hop": [], "gsrm_cold": [], "gsrm_warm": [],
                                           "text_search": []}
        for n, item in enumerate(items):  # the first is a warm-up
            stage: dict[str, float] = {}
            started = time.perf_counter()
            entities = tools.question_entities([item])
            stage["entity_linking"] = time.perf_counter() - started
            started = time.perf_counter()
            tools.one_hop(entities, config.max_triples_per_relation)
            stage["one_hop"] = time.perf_counter() - started
            started = time.perf_counter()
            gsrm_items(tools, [item], config)
            stage["gsrm_cold"] = time.perf_counter() - started
            if has_chunks:
                started = time.perf_counter()
                retriever.search_text([item.question], k=10)
                stage["text_search"] = time.perf_counter() - started
            if n:
                for name, seconds in stage.items():
                    timings[name].append(seconds)
        # Warm: every triple of these subgraphs has its vector now, as in a home whose edges are all embedded
        # (a full release's edge_embeddings take days on 2 cores, so the scale run cannot store them).
        for item in items[1:]:
            started = time.perf_counter()
            gsrm_items(tools, [item], config)
            timings["gsrm_warm"].append(time.perf_counter() - started)
    result = {
        "home": str(load_settings().home), **sizes, "questions": len(items) - 1, **one_off,
        "triples_encoded_on_the_fly": tools.triples_encoded,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "stages": {name: {"p50_ms": round(1000 * statistics.median(v), 1),
                          "p95_ms": round(1000 * percentile(v, 0.95), 1), "max_ms": round(1000 * max(v), 1)}
                   for name, v in timings.items() if v},
    }
    if not has_chunks:
        result["text_search"] = "not measured: embeddings.chunk_embeddings is absent in this home"
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
