"""Build the packaged PubMedQA abstract corpus from PQA-L's dev file (run once; the output is committed).

    python -m medgraph.text.data.build_pubmedqa_corpus ../shared/data/pubmedqa/pqal_dev.json

Each of the 500 PQA-L abstracts outside its test set becomes one line `{"id": "pubmed:<PMID>",
"title": "PMID <PMID>", "text": <the CONTEXTS joined>}`. Only the abstract's context passages
are kept: the question (which would hand the reader its own query), the section labels, MeSH
terms, the long answer (the abstract's conclusion, the answer itself) and the yes/no/maybe label
are left out. The gzip header carries no timestamp, so the same input gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
from pathlib import Path

from medgraph.files import write_atomically

PACKAGED_FILE = Path(__file__).with_name("pubmedqa_pqal_abstracts.jsonl.gz")


def abstract_records(pqal: dict[str, dict]) -> list[dict[str, str]]:
    """One corpus record per PubMed id, in PMID order."""
    records = []
    for pmid in sorted(pqal, key=int):
        contexts = pqal[pmid].get("CONTEXTS") or []
        text = " ".join(str(c).strip() for c in contexts if str(c).strip())
        if text:
            records.append({"id": f"pubmed:{pmid}", "title": f"PMID {pmid}", "text": text})
    return records


def write_corpus(records: list[dict[str, str]], out: Path) -> Path:
    """Gzipped JSONL (a few MB), compressed in memory and written atomically to `out`."""
    compressed = io.BytesIO()
    with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=0, filename="") as handle:
        for record in records:
            handle.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    return write_atomically(out, compressed.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pqal_dev", type=Path, help="PubMedQA pqal_dev.json (PQA-L without its test set)")
    parser.add_argument("--out", type=Path, default=PACKAGED_FILE)
    args = parser.parse_args(argv)
    with open(args.pqal_dev, encoding="utf-8") as handle:
        records = abstract_records(json.load(handle))
    path = write_corpus(records, args.out)
    print(f"{len(records)} abstracts -> {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
