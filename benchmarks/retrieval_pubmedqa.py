"""Retrieval quality on real text: does each PubMedQA question retrieve its own abstract?

Corpus: the 500 expert-labelled PubMedQA (PQA-L) dev items in ../shared/data/pubmedqa,
each abstract's CONTEXTS sections (its conclusion, LONG_ANSWER, is left out so
the answer is not in the text). Each question is searched with BM25 (DuckDB
fts), dense (MiniLM + exact inner product) and hybrid (reciprocal rank fusion);
Recall@k is the share of questions whose own abstract is among the top k.

    .venv/bin/python benchmarks/retrieval_pubmedqa.py [--pubmedqa PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from medgraph.embed.encoder import load_encoder
from medgraph.embed.tables import embed_source
from medgraph.retrieval import Retriever
from medgraph.storage import Lake, Warehouse
from medgraph.text.corpus import build_corpus_chunks

DEFAULT_PUBMEDQA = Path(__file__).resolve().parents[2] / "shared" / "data" / "pubmedqa" / "pqal_dev.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pubmedqa", type=Path, default=DEFAULT_PUBMEDQA)
    parser.add_argument("--work-dir", type=Path, default=Path(__file__).parent / "_work" / "retrieval_pubmedqa")
    args = parser.parse_args()
    if not args.pubmedqa.exists():
        raise SystemExit(f"PubMedQA file not found: {args.pubmedqa} (see ../shared/data/README.md)")

    items = json.loads(args.pubmedqa.read_text())
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    corpus = args.work_dir / "pqal_dev.jsonl"
    with corpus.open("w") as out:
        for pmid, item in items.items():
            out.write(json.dumps({"id": pmid, "title": "", "text": "\n\n".join(item["CONTEXTS"])}) + "\n")
    questions = [(pmid, item["QUESTION"]) for pmid, item in items.items()]

    warehouse = Warehouse(args.work_dir / "warehouse.duckdb", Lake(args.work_dir / "lake"))
    started = time.perf_counter()
    stats = build_corpus_chunks(warehouse, [corpus], sources=())
    encoder = load_encoder("minilm")
    embed_source(warehouse, "chunk_embeddings", encoder, progress=True)
    print(f"{stats.documents} abstracts, {stats.chunks} chunks indexed in {time.perf_counter() - started:.1f}s")

    print(f"\n{len(questions)} questions, each must retrieve its own abstract")
    print(f"{'mode':<8}{'Recall@1':>10}{'Recall@10':>11}{'ms/query':>10}")
    with Retriever(warehouse, encoder) as retriever:
        doc_of = dict(retriever.graph.con.execute("SELECT chunk_id, doc_id FROM text.corpus_chunks").fetchall())
        for mode in ("bm25", "dense", "hybrid"):
            started = time.perf_counter()
            hits = retriever.search_text([q for _, q in questions], k=10, mode=mode)
            per_query = (time.perf_counter() - started) * 1000 / len(questions)
            ranked = [[doc_of[c] for c, _ in row] for row in hits]
            r1 = sum(pmid in docs[:1] for (pmid, _), docs in zip(questions, ranked)) / len(questions)
            r10 = sum(pmid in docs[:10] for (pmid, _), docs in zip(questions, ranked)) / len(questions)
            print(f"{mode:<8}{r1:>10.3f}{r10:>11.3f}{per_query:>10.1f}")


if __name__ == "__main__":
    main()
