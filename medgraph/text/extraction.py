"""Graph construction from text as Graph-R1 / HyperGraphRAG do it: n-ary relations extracted from chunks by an LLM.

Each corpus chunk is shown to the configured chat model, which writes the
knowledge facts it states, one JSON object per line: the fact as a complete
sentence and the entities it involves (any number: an n-ary relation). Every
fact becomes a hyperedge over the concepts its entities name, linked to CUIs
with the KG's name dictionary (`medgraph.text.mentions.ConceptDictionary`, the
matcher that builds `kg.kg_chunk_mentions`).

- `text.chunk_hyperedges(hyperedge_id, chunk_id, relation_text, entities[], cuis[], model)`
- `text.chunk_hyperedge_runs(chunk_id, model, hyperedges, prompt_tokens, completion_tokens, parse_failed,
  extracted_at)`: which chunks each model has done, and what they cost.

Batched (one `generate` per `batch_chunks` chunks) and resumable: chunks the
same model has done are skipped, and each batch is committed in one DuckDB
transaction (its hyperedges and its run rows together), so an interrupted run
loses at most the batch in flight. Both tables are published to the lake
(atomic replace) at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from medgraph.llm.base import ChatModel, GenerationConfig, system, user
from medgraph.settings import DEFAULT_LLM
from medgraph.storage import Warehouse, quote_ident, sql_literal, transaction
from medgraph.text.mentions import ConceptDictionary, TextChunk, read_chunks

log = logging.getLogger(__name__)

SCHEMA = "text"
HYPEREDGES_TABLE = "chunk_hyperedges"
RUNS_TABLE = "chunk_hyperedge_runs"
# The default LLM of a demo: too small to extract relations worth keeping (it mostly echoes the text).
TINY_LLMS = frozenset({DEFAULT_LLM})
MIN_LINK_SCORE = 0.9  # mentions at or above this score link an entity to a concept (as evidence recall does)

EXTRACTION_SYSTEM = "You extract knowledge from biomedical text. Reply only with JSON lines."
EXTRACTION_PROMPT = """Text:
{text}

List the knowledge facts this text states. A fact may involve two or more entities (diseases, drugs,
genes, findings, procedures, populations). Write one JSON object per line, nothing else:
{{"fact": "<the fact as one complete sentence>", "entities": ["<entity name>", "<entity name>", ...]}}"""


@dataclass(frozen=True)
class Hyperedge:
    hyperedge_id: str
    chunk_id: str
    relation_text: str
    entities: list[str]
    cuis: list[str]
    model: str


@dataclass
class ExtractionStats:
    chunks_total: int = 0
    chunks_skipped_done: int = 0  # done by this model in an earlier run
    chunks_extracted: int = 0
    hyperedges: int = 0  # added by this run
    hyperedges_in_table: int = 0  # every model's, every run's
    hyperedges_linked: int = 0  # with at least two concepts: a hyperedge of the graph
    parse_failures: int = 0  # replies with no readable fact
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated_usd: float = 0.0
    seconds: float = 0.0
    skipped_reason: str | None = None  # set when nothing was run

    def as_metadata(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def is_tiny_llm(llm: ChatModel) -> bool:
    """Whether `llm` is the demo's tiny default, which cannot extract relations usefully."""
    return llm.name in TINY_LLMS


def parse_facts(text: str) -> list[tuple[str, list[str]]]:
    """(fact, entity names) from a reply: JSON objects, one per line (a list of them, or a code fence, also
    work). Objects without a fact, and entity names that are not strings, are skipped."""
    facts: list[tuple[str, list[str]]] = []
    candidates: list[object] = []
    try:
        whole = json.loads(text.strip().removeprefix("```json").removeprefix("```").removesuffix("```"))
        candidates = whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        candidates = [_json_line(line) for line in text.splitlines() if "{" in line]
    for value in candidates:
        if not isinstance(value, dict):
            continue
        fact = value.get("fact") or value.get("relation") or value.get("text")
        entities = value.get("entities") or []
        if isinstance(fact, str) and fact.strip() and isinstance(entities, list):
            names = [e.strip() for e in entities if isinstance(e, str) and e.strip()]
            facts.append((" ".join(fact.split()), list(dict.fromkeys(names))))
    return facts


def _json_line(line: str) -> object:
    """The JSON object of one reply line ("- {...}," and "1. {...}" too), or None."""
    try:
        return json.loads(line[line.index("{"):line.rindex("}") + 1])
    except (ValueError, json.JSONDecodeError):
        return None


def link_entities(dictionary: ConceptDictionary, names: Sequence[str]) -> list[str]:
    """The CUIs the entity names name (each name's dictionary matches), in order, without repeats."""
    cuis = [m.cui for i, name in enumerate(names) for m in dictionary.find(TextChunk(str(i), "", name))
            if m.score >= MIN_LINK_SCORE]
    return list(dict.fromkeys(cuis))


def hyperedge_id(chunk_id: str, model: str, index: int) -> str:
    """Stable across runs: the same chunk, model and fact position give the same id."""
    return "he_" + hashlib.sha1(f"{chunk_id}\x1f{model}\x1f{index}".encode()).hexdigest()[:16]


def _create_tables(con) -> None:
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(SCHEMA)}")
    con.execute(f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.{HYPEREDGES_TABLE} (
        hyperedge_id VARCHAR PRIMARY KEY, chunk_id VARCHAR NOT NULL, relation_text VARCHAR NOT NULL,
        entities VARCHAR[] NOT NULL, cuis VARCHAR[] NOT NULL, model VARCHAR NOT NULL)""")
    con.execute(f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.{RUNS_TABLE} (
        chunk_id VARCHAR NOT NULL, model VARCHAR NOT NULL, hyperedges INTEGER NOT NULL,
        prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, parse_failed BOOLEAN NOT NULL,
        extracted_at TIMESTAMP NOT NULL, PRIMARY KEY (chunk_id, model))""")


def _done_chunks(warehouse: Warehouse, model: str) -> set[str]:
    with warehouse.connect() as con:
        _create_tables(con)
        rows = con.execute(f"SELECT chunk_id FROM {SCHEMA}.{RUNS_TABLE} WHERE model = $m", {"m": model}).fetchall()
    return {row[0] for row in rows}


def extract_chunk_hyperedges(warehouse: Warehouse, llm: ChatModel, *, batch_chunks: int = 16,
                             max_chunks: int | None = None, max_new_tokens: int = 512, max_text_chars: int = 6000,
                             prompt_usd_per_1k: float = 0.0, completion_usd_per_1k: float = 0.0,
                             allow_tiny_llm: bool = False,
                             dictionary: ConceptDictionary | None = None) -> ExtractionStats:
    """Extract n-ary relations from the corpus chunks the model has not done yet (at most `max_chunks`)
    into `text.chunk_hyperedges`; see the module docstring. Returns what was done and what it cost;
    with the tiny default LLM nothing runs (`skipped_reason` says why) unless `allow_tiny_llm`."""
    started = time.perf_counter()
    stats = ExtractionStats()
    if is_tiny_llm(llm) and not allow_tiny_llm:
        stats.skipped_reason = (f"the configured LLM {llm.name!r} is the tiny default: it cannot extract relations "
                                "usefully. Set MEDGRAPH_LLM to an OpenAI-compatible endpoint (e.g. vLLM on a GPU) "
                                "or a larger local model.")
        log.warning("chunk hyperedges skipped: %s", stats.skipped_reason)
        return stats
    if batch_chunks < 1:
        raise ValueError(f"batch_chunks must be >= 1, got {batch_chunks}")
    dictionary = dictionary or ConceptDictionary.from_warehouse(warehouse)
    done = _done_chunks(warehouse, llm.name)
    generation = GenerationConfig(max_new_tokens=max_new_tokens)
    pending: list[TextChunk] = []

    for batch in read_chunks(warehouse.lake):
        for chunk in batch:
            stats.chunks_total += 1
            if chunk.chunk_id in done:
                stats.chunks_skipped_done += 1
                continue
            if max_chunks is not None and stats.chunks_extracted + len(pending) >= max_chunks:
                continue
            pending.append(chunk)
            if len(pending) == batch_chunks:
                _extract_batch(warehouse, llm, dictionary, pending, generation, max_text_chars, stats)
                pending = []
    if pending:
        _extract_batch(warehouse, llm, dictionary, pending, generation, max_text_chars, stats)
    _publish(warehouse)
    with warehouse.connect(read_only=True) as con:
        stats.hyperedges_in_table = con.execute(f"SELECT count(*) FROM {SCHEMA}.{HYPEREDGES_TABLE}").fetchone()[0]
    stats.estimated_usd = round(stats.prompt_tokens / 1000 * prompt_usd_per_1k
                                + stats.completion_tokens / 1000 * completion_usd_per_1k, 6)
    stats.seconds = time.perf_counter() - started
    return stats


def _extract_batch(warehouse: Warehouse, llm: ChatModel, dictionary: ConceptDictionary, chunks: list[TextChunk],
                   generation: GenerationConfig, max_text_chars: int, stats: ExtractionStats) -> None:
    """One LLM call for a batch of chunks; their hyperedges and run rows are written together, counted in `stats`."""
    conversations = [[system(EXTRACTION_SYSTEM), user(EXTRACTION_PROMPT.format(text=c.text[:max_text_chars]))]
                     for c in chunks]
    completions = llm.generate(conversations, generation)
    edges: list[Hyperedge] = []
    runs = []
    for chunk, completion in zip(chunks, completions, strict=True):
        facts = parse_facts(completion.text)
        found = [Hyperedge(hyperedge_id(chunk.chunk_id, llm.name, i), chunk.chunk_id, fact, names,
                           link_entities(dictionary, names), llm.name) for i, (fact, names) in enumerate(facts)]
        edges += found
        runs.append((chunk.chunk_id, llm.name, len(found), completion.prompt_tokens, completion.completion_tokens,
                     not facts))
        stats.parse_failures += not facts
        stats.prompt_tokens += completion.prompt_tokens
        stats.completion_tokens += completion.completion_tokens
    # The batch's hyperedges and run rows commit together, or not at all.
    with warehouse.connect() as con, transaction(con):
        if edges:
            con.executemany(f"INSERT OR REPLACE INTO {SCHEMA}.{HYPEREDGES_TABLE} VALUES (?, ?, ?, ?, ?, ?)",
                            [(e.hyperedge_id, e.chunk_id, e.relation_text, e.entities, e.cuis, e.model)
                             for e in edges])
        con.executemany(f"INSERT OR REPLACE INTO {SCHEMA}.{RUNS_TABLE} VALUES (?, ?, ?, ?, ?, ?, now())", runs)
    stats.chunks_extracted += len(chunks)
    stats.hyperedges += len(edges)
    stats.hyperedges_linked += sum(len(e.cuis) >= 2 for e in edges)
    log.info("chunk hyperedges: %d chunks done, %d hyperedges, %d prompt + %d completion tokens",
             stats.chunks_extracted, stats.hyperedges, stats.prompt_tokens, stats.completion_tokens)


def _publish(warehouse: Warehouse) -> None:
    """Both tables to the lake, each replaced atomically."""
    lake = warehouse.lake
    for table in (HYPEREDGES_TABLE, RUNS_TABLE):
        staged = lake.staging_path(SCHEMA, table)
        try:
            with warehouse.connect() as con:
                con.execute(f"COPY {SCHEMA}.{table} TO {sql_literal(str(staged))} (FORMAT parquet, COMPRESSION zstd)")
            lake.publish(staged, SCHEMA, table)
        finally:
            lake.discard(staged)
