"""Chunk -> concept mentions (`kg.kg_chunk_mentions`) and chunk <-> chunk links (`kg.kg_chunk_links`).

This is what joins the text side to the graph: Graph-R1's knowledge hypergraph
has chunks and entities as nodes, A2RAG and SEMA-RAG move from retrieved text
to KG concepts and back. A chunk mentions a concept where one of the
concept's names (preferred name or synonym in `kg.kg_nodes`) occurs in it.

Matching is a dictionary lookup over word n-grams, not a scan of all names
per chunk: names are split into normalized words (lowercase, accents and
possessive 's removed, any punctuation or whitespace between words treated
alike) and stored by their word sequence, together with the set of every
shorter prefix, so scanning a chunk extends an n-gram only while some name
still starts with it. Each position costs one or two dictionary lookups, so
time is linear in the text and independent of the number of names. The
longest name wins, left to right, and a match never crosses sentence
punctuation.

- exact: the normalized word sequence equals a name's (score 1.0). A name's
  parenthesised or bracketed qualifiers and a trailing "NOS" are dropped
  ("Seizure (finding)" is also "seizure"). All-caps acronyms ("COPD") match
  only in capitals.
- fuzzy: equal after singularizing each word (Harman's S-stemmer) and joining
  the words without separators, which catches plural/singular forms
  ("seizures" ~ "seizure") and joined hyphen variants ("xray" ~ "X-ray"). The
  score is the character similarity of the two normalized forms (difflib
  ratio), below 1.0.

Names are skipped when they would link noise rather than meaning: shorter
than `min_name_chars`, made only of stop words or digits, longer than
`max_name_tokens` words, or shared by more than `max_concepts_per_name`
concepts.

Hook for a later LLM pass: `link_chunk_mentions(extract=...)` takes any
callable `extract(chunks: Sequence[TextChunk]) -> Iterable[Mention]`, called on
batches of chunks; the default is the `ConceptDictionary` built from the KG.
An LLM extractor (entities with a chat model, mapped to CUIs) can be passed
alone or chained with the dictionary:
`extract=lambda chunks: [*dictionary(chunks), *llm_mentions(chunks)]`. Give its
mentions their own `match_type` (e.g. 'llm'). Mentions of CUIs that are not
KG nodes are dropped and counted; duplicates of one span and CUI keep the
highest score. Relations such an extractor finds belong in a table of their
own, not here.
"""

from __future__ import annotations

import difflib
import logging
import re
import time
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from medgraph.s3 import S3Lake
from medgraph.storage import Lake, Warehouse, quote_ident, reading_lake_file, sql_literal, transaction

log = logging.getLogger(__name__)

SCHEMA = "kg"
MENTIONS_TABLE = "kg_chunk_mentions"
LINKS_TABLE = "kg_chunk_links"
CHUNKS_SCHEMA, CHUNKS_TABLE = "text", "corpus_chunks"

DEFAULT_MAX_CHUNKS_PER_CONCEPT = 50
_BATCH_CHUNKS = 1000

# Function words that are also (useless) concept names in UMLS ("Was", "All", "Same", ...).
STOPWORDS = frozenset([
    "a", "about", "above", "after", "again", "against", "all", "also", "am", "an", "and", "any", "are",
    "as", "at", "be", "because", "been", "before", "being", "below", "between", "both", "but", "by", "can",
    "could", "did", "do", "does", "doing", "down", "during", "each", "either", "else", "ever", "few", "for",
    "from", "further", "had", "has", "have", "having", "he", "her", "here", "hers", "herself", "him",
    "himself", "his", "how", "however", "i", "if", "in", "into", "is", "it", "its", "itself", "just",
    "least", "less", "let", "may", "me", "might", "more", "most", "much", "must", "my", "myself", "neither",
    "no", "nor", "not", "now", "of", "off", "on", "once", "one", "only", "or", "other", "our", "ours",
    "ourselves", "out", "over", "own", "per", "same", "shall", "she", "should", "since", "so", "some",
    "such", "than", "that", "the", "their", "theirs", "them", "themselves", "then", "there", "these",
    "they", "this", "those", "though", "through", "thus", "to", "too", "under", "until", "up", "upon", "us",
    "very", "via", "was", "we", "were", "what", "when", "where", "whether", "which", "while", "who", "whom",
    "whose", "why", "will", "with", "within", "without", "would", "yet", "you", "your", "yours", "yourself",
    "yourselves",
])

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
# Punctuation that ends a phrase: a name never spans it ("... the seizure. Disorder of ...").
_BREAK = re.compile(r"[.;:!?\"“”|]|\n\s*\n")
_QUALIFIERS = re.compile(r"\([^()]*\)|\[[^\[\]]*\]|(?:,\s*|\s+)NOS\b")


@dataclass(frozen=True)
class TextChunk:
    """A text that mentions are found in: a corpus chunk, or any text given an id (a question, a name)."""

    chunk_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Mention:
    """`text[start_char:end_char] == mention`, offsets relative to the chunk's text."""

    chunk_id: str
    cui: str
    mention: str
    match_type: str
    score: float
    start_char: int
    end_char: int


MentionExtractor = Callable[[Sequence[TextChunk]], Iterable[Mention]]


# -----------------------------------------------------------------------------
# Normalization

def normalize_word(word: str) -> str:
    """Lowercase, accents stripped, possessive 's and apostrophes dropped ("Crohn's" -> "crohn")."""
    word = word.lower()
    if not word.isascii():
        word = "".join(c for c in unicodedata.normalize("NFKD", word) if not unicodedata.combining(c))
    if word.endswith(("'s", "’s")):
        word = word[:-2]
    return word.replace("'", "").replace("’", "")


def singular(word: str) -> str:
    """Harman's S-stemmer: a conservative plural -> singular that rarely merges different words."""
    if len(word) < 4 or not word.isalpha():
        return word
    if word.endswith("ies") and not word.endswith(("eies", "aies")):
        return word[:-3] + "y"
    if word.endswith("es") and not word.endswith(("aes", "ees", "oes")):
        return word[:-1]
    if word.endswith("s") and not word.endswith(("us", "ss")):
        return word[:-1]
    return word


def _is_acronym(word: str) -> bool:
    return word.isupper() and word.isalnum() and len(word) <= 8


@lru_cache(maxsize=200_000)
def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


@lru_cache(maxsize=500_000)
def _word_forms(word: str) -> tuple[str, str]:
    """(normalized, singularized) forms of a word; cached, as the same words recur across chunks."""
    norm = normalize_word(word)
    return norm, singular(norm)


# -----------------------------------------------------------------------------
# The dictionary matcher

@dataclass
class ConceptDictionary:
    """Concept names indexed by normalized word sequence; calling it on chunks finds mentions.

    `exact` maps "w1 w2 ..." to CUIs, `loose` maps the singularized, joined
    words to {CUI: the name's normalized form}; each `*_prefixes` set holds
    the proper word-prefixes of its keys, which is what lets a scan stop early.
    """

    exact: dict[str, tuple[str, ...]]
    loose: dict[str, dict[str, str]]
    acronyms: dict[str, tuple[str, ...]]
    exact_prefixes: set[str]
    loose_prefixes: set[str]
    max_tokens: int
    skipped: Counter[str] = field(default_factory=Counter)

    @classmethod
    def from_names(cls, names: Iterable[tuple[str, str]], min_name_chars: int = 3, max_name_tokens: int = 12,
                   max_concepts_per_name: int = 5) -> ConceptDictionary:
        """Index (cui, name) pairs; see the module docstring for which names are skipped."""
        exact: dict[str, set[str]] = defaultdict(set)
        loose: dict[str, dict[str, str]] = defaultdict(dict)
        acronyms: dict[str, set[str]] = defaultdict(set)
        exact_prefixes: set[str] = set()
        loose_prefixes: set[str] = set()
        skipped: Counter[str] = Counter()
        max_tokens = 1
        for cui, name in names:
            if not name:
                continue
            unqualified = " ".join(_QUALIFIERS.sub(" ", name).split())
            for variant in {name, unqualified} if unqualified else {name}:
                raw = _WORD.findall(variant)
                if not raw:
                    continue
                if len(raw) == 1 and _is_acronym(raw[0]) and raw[0] == variant.strip():
                    if len(raw[0]) < min_name_chars:
                        skipped["too_short"] += 1
                    else:
                        acronyms[raw[0]].add(cui)
                    continue
                norms = [normalize_word(w) for w in raw]
                if len(norms) > max_name_tokens:
                    skipped["too_long"] += 1
                    continue
                if sum(len(w) for w in norms) < min_name_chars:
                    skipped["too_short"] += 1
                    continue
                if all(w in STOPWORDS or w.isdigit() for w in norms):
                    skipped["stop_words"] += 1
                    continue
                key = " ".join(norms)
                exact[key].add(cui)
                exact_prefixes.update(" ".join(norms[:i]) for i in range(1, len(norms)))
                loose_words = [singular(w) for w in norms]
                loose_key = "".join(loose_words)
                loose[loose_key].setdefault(cui, key)
                loose_prefixes.update("".join(loose_words[:i]) for i in range(1, len(loose_words)))
                max_tokens = max(max_tokens, len(norms))

        def unambiguous(index: dict, count: bool = True) -> dict:
            kept = {key: value for key, value in index.items() if len(value) <= max_concepts_per_name}
            if count:  # names, not their fuzzy forms
                skipped["ambiguous"] += len(index) - len(kept)
            return kept

        return cls(
            exact={key: tuple(sorted(cuis)) for key, cuis in unambiguous(exact).items()},
            loose=unambiguous(loose, count=False),
            acronyms={key: tuple(sorted(cuis)) for key, cuis in unambiguous(acronyms).items()},
            exact_prefixes=exact_prefixes,
            loose_prefixes=loose_prefixes,
            max_tokens=max_tokens,
            skipped=skipped,
        )

    @classmethod
    def from_warehouse(cls, warehouse: Warehouse, **options: int) -> ConceptDictionary:
        """Preferred names and synonyms of every node in `kg.kg_nodes`."""
        with warehouse.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT cui, unnest(list_prepend(preferred_name, coalesce(synonyms, []))) FROM kg.kg_nodes"
            ).fetchall()
        return cls.from_names(rows, **options)

    @property
    def names(self) -> int:
        return len(self.exact) + len(self.acronyms)

    def __call__(self, chunks: Sequence[TextChunk]) -> list[Mention]:
        return [m for chunk in chunks for m in self.find(chunk)]

    def find(self, chunk: TextChunk) -> Iterator[Mention]:
        """Longest matches, left to right, in one chunk's text."""
        text = chunk.text
        words = list(_WORD.finditer(text))
        forms = [_word_forms(w.group()) for w in words]
        n, i = len(words), 0
        while i < n:
            end, match_type, cuis = self._longest_match(text, words, forms, i)
            if end is None:
                i += 1
                continue
            start_char, end_char = words[i].start(), words[end - 1].end()
            surface = text[start_char:end_char]
            if match_type == "exact":
                for cui in cuis:
                    yield Mention(chunk.chunk_id, cui, surface, "exact", 1.0, start_char, end_char)
            else:
                mention_norm = " ".join(norm for norm, _ in forms[i:end])
                for cui, name_norm in sorted(cuis.items()):
                    yield Mention(chunk.chunk_id, cui, surface, "fuzzy",
                                  round(_similarity(mention_norm, name_norm), 4), start_char, end_char)
            i = end

    def _longest_match(self, text: str, words: list[re.Match], forms: list[tuple[str, str]],
                       i: int) -> tuple[int | None, str, object]:
        """(end word, 'exact'|'fuzzy', CUIs) of the longest name starting at word i, or (None, '', None)."""
        best: tuple[int | None, str, object] = (None, "", None)
        key, loose_key = forms[i]
        raw = words[i].group()
        if raw in self.acronyms:
            best = (i + 1, "exact", self.acronyms[raw])
        if key in self.exact:
            best = (i + 1, "exact", self.exact[key])
        elif loose_key in self.loose and best[0] is None:
            best = (i + 1, "fuzzy", self.loose[loose_key])
        exact_open, loose_open = key in self.exact_prefixes, loose_key in self.loose_prefixes
        for j in range(i + 1, min(len(words), i + self.max_tokens)):
            if not (exact_open or loose_open) or _BREAK.search(text, words[j - 1].end(), words[j].start()):
                break
            norm, loose_word = forms[j]
            if exact_open:
                key = f"{key} {norm}"
                if key in self.exact:
                    best = (j + 1, "exact", self.exact[key])
                exact_open = key in self.exact_prefixes
            if loose_open:
                loose_key += loose_word
                if loose_key in self.loose and best[0] != j + 1:
                    best = (j + 1, "fuzzy", self.loose[loose_key])
                loose_open = loose_key in self.loose_prefixes
        return best


# -----------------------------------------------------------------------------
# Building the tables

MENTION_SCHEMA = pa.schema([
    ("chunk_id", pa.string()),
    ("cui", pa.string()),
    ("mention", pa.string()),
    ("match_type", pa.string()),
    ("score", pa.float64()),
    ("start_char", pa.int64()),
    ("end_char", pa.int64()),
])


@dataclass
class MentionStats:
    """What one linking run did; becomes Dagster metadata."""

    chunks: int = 0
    chunks_with_mentions: int = 0
    mentions: int = 0
    mentions_by_type: dict[str, int] = field(default_factory=dict)
    mentions_dropped_unknown_cui: int = 0
    concepts: int = 0
    concepts_over_fan_out_cap: int = 0
    links: int = 0
    max_chunks_per_concept: int = DEFAULT_MAX_CHUNKS_PER_CONCEPT
    names_indexed: int | None = None
    names_skipped: dict[str, int] = field(default_factory=dict)
    matching_seconds: float = 0.0
    seconds: float = 0.0

    def as_metadata(self) -> dict[str, object]:
        metadata: dict[str, object] = {
            "tables": f"{SCHEMA}.{MENTIONS_TABLE}, {SCHEMA}.{LINKS_TABLE}",
            "chunks": self.chunks,
            "chunks_with_mentions": self.chunks_with_mentions,
            "mentions": self.mentions,
            "mentions_dropped_unknown_cui": self.mentions_dropped_unknown_cui,
            "concepts_mentioned": self.concepts,
            "concepts_over_fan_out_cap": self.concepts_over_fan_out_cap,
            "max_chunks_per_concept": self.max_chunks_per_concept,
            "chunk_links": self.links,
            "matching_seconds": round(self.matching_seconds, 3),
            "chunks_per_second": round(self.chunks / self.matching_seconds) if self.matching_seconds else 0,
            "seconds": round(self.seconds, 3),
        }
        metadata.update({f"mentions_{kind}": count for kind, count in sorted(self.mentions_by_type.items())})
        if self.names_indexed is not None:
            metadata["names_indexed"] = self.names_indexed
        metadata.update({f"names_skipped_{why}": count for why, count in sorted(self.names_skipped.items())})
        return metadata


def read_chunks(lake: Lake | S3Lake, batch_rows: int = _BATCH_CHUNKS) -> Iterator[list[TextChunk]]:
    """Batches of the published corpus chunks, streamed from the lake (no warehouse lock held)."""
    path = lake.table_path(CHUNKS_SCHEMA, CHUNKS_TABLE)
    if not lake.exists(path):
        raise FileNotFoundError(f"{path} not found: build text.corpus_chunks first (medgraph.text.corpus)")
    columns = ["chunk_id", "title", "text"]
    with lake.local_copy(path) as local, reading_lake_file(path):
        for batch in pq.ParquetFile(local).iter_batches(batch_size=batch_rows, columns=columns):
            ids, titles, texts = (batch.column(i).to_pylist() for i in range(3))
            yield [TextChunk(c, t or "", x) for c, t, x in zip(ids, titles, texts)]


def _write_mentions(batches: Iterable[list[TextChunk]], extract: MentionExtractor, path: Path,
                    stats: MentionStats) -> None:
    """Run `extract` on each batch and stream its mentions into a Parquet file."""
    with pq.ParquetWriter(path, MENTION_SCHEMA, compression="zstd") as writer:
        for chunks in batches:
            ids = {chunk.chunk_id for chunk in chunks}
            mentions = list(extract(chunks))
            strays = [m for m in mentions if m.chunk_id not in ids]
            if strays:
                raise ValueError(f"extract returned a mention of chunk {strays[0].chunk_id!r}, "
                                 "which is not in the batch it was given")
            stats.chunks += len(chunks)
            if mentions:
                columns = {name: [getattr(m, name) for m in mentions] for name in MENTION_SCHEMA.names}
                writer.write_table(pa.table(columns, schema=MENTION_SCHEMA))


def link_chunk_mentions(
    warehouse: Warehouse,
    extract: MentionExtractor | None = None,
    max_chunks_per_concept: int = DEFAULT_MAX_CHUNKS_PER_CONCEPT,
    batch_chunks: int = _BATCH_CHUNKS,
) -> MentionStats:
    """(Re)build `kg.kg_chunk_mentions` and `kg.kg_chunk_links` from the published corpus chunks.

    `extract` finds the mentions (default: a ConceptDictionary of the KG's
    names). Two chunks are linked when they mention a common concept, unless
    that concept is mentioned in more than `max_chunks_per_concept` chunks (a
    generic concept would otherwise add a quadratic clique). A link's weight
    sums ln(1 + chunks / chunks mentioning c) over its shared concepts c, so
    rare shared concepts count more. Both tables are replaced in one
    transaction and then published to the lake.
    """
    started = time.perf_counter()
    if max_chunks_per_concept < 2:
        raise ValueError(f"max_chunks_per_concept must be at least 2, got {max_chunks_per_concept}")
    stats = MentionStats(max_chunks_per_concept=max_chunks_per_concept)
    if extract is None:
        extract = ConceptDictionary.from_warehouse(warehouse)
    if isinstance(extract, ConceptDictionary):
        stats.names_indexed, stats.names_skipped = extract.names, dict(extract.skipped)

    lake = warehouse.lake
    raw = lake.scratch_path(SCHEMA, f"{MENTIONS_TABLE}_raw")  # pyarrow writes it: always a local file
    staged = {table: lake.staging_path(SCHEMA, table) for table in (MENTIONS_TABLE, LINKS_TABLE)}
    try:
        matching_started = time.perf_counter()
        _write_mentions(read_chunks(lake, batch_chunks), extract, raw, stats)
        stats.matching_seconds = time.perf_counter() - matching_started
        with warehouse.connect() as con, transaction(con):
            _replace_tables(con, raw, max_chunks_per_concept, stats)
            for table, path in staged.items():
                con.execute(f"COPY {quote_ident(SCHEMA)}.{quote_ident(table)} "
                            f"TO {sql_literal(str(path))} (FORMAT parquet, COMPRESSION zstd)")
        for table, path in staged.items():
            lake.publish(path, SCHEMA, table)
    finally:
        for path in (raw, *staged.values()):
            lake.discard(path)
    stats.seconds = time.perf_counter() - started
    log.info("chunk mentions: %d chunks, %d mentions, %d links in %.1fs (matching %.0f chunks/s)",
             stats.chunks, stats.mentions, stats.links, stats.seconds,
             stats.chunks / stats.matching_seconds if stats.matching_seconds else 0)
    return stats


def _replace_tables(con: duckdb.DuckDBPyConnection, raw: Path, max_chunks_per_concept: int,
                    stats: MentionStats) -> None:
    """Mentions (deduplicated, KG concepts only) and the capped co-occurrence links, as tables."""
    mentions = f"{quote_ident(SCHEMA)}.{quote_ident(MENTIONS_TABLE)}"
    links = f"{quote_ident(SCHEMA)}.{quote_ident(LINKS_TABLE)}"
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(SCHEMA)}")
    # One row per (chunk, concept, span): a span found twice (dictionary and LLM) keeps its best score.
    con.execute(
        f"""
        CREATE OR REPLACE TABLE {mentions} AS
        SELECT m.chunk_id, m.cui, arg_max(m.mention, m.score) AS mention,
               arg_max(m.match_type, m.score) AS match_type, max(m.score) AS score, m.start_char, m.end_char
        FROM read_parquet({sql_literal(str(raw))}) AS m
        WHERE m.cui IN (SELECT cui FROM kg.kg_nodes)
        GROUP BY m.chunk_id, m.cui, m.start_char, m.end_char
        """
    )
    raw_count = con.execute(f"SELECT count(*) FROM read_parquet({sql_literal(str(raw))}) "
                            "WHERE cui NOT IN (SELECT cui FROM kg.kg_nodes)").fetchone()[0]
    stats.mentions_dropped_unknown_cui = raw_count
    con.execute(
        f"""
        CREATE OR REPLACE TABLE {links} AS
        WITH chunk_concepts AS (
            SELECT DISTINCT chunk_id, cui FROM {mentions}
        ),
        concept_chunks AS (
            SELECT cui, count(*) AS chunks FROM chunk_concepts GROUP BY cui
        ),
        corpus AS (
            SELECT count(*) AS chunks FROM {quote_ident(CHUNKS_SCHEMA)}.{quote_ident(CHUNKS_TABLE)}
        )
        SELECT a.chunk_id AS chunk_a, b.chunk_id AS chunk_b,
               list(a.cui ORDER BY a.cui) AS shared_concepts,
               -- Summed in concept order: a parallel sum adds in any order, and the last bits of the
               -- weight then differ from run to run (the same data must give the same table).
               sum(ln(1 + corpus.chunks / c.chunks) ORDER BY a.cui) AS weight
        FROM chunk_concepts AS a
        JOIN concept_chunks AS c ON c.cui = a.cui AND c.chunks BETWEEN 2 AND {int(max_chunks_per_concept)}
        JOIN chunk_concepts AS b ON b.cui = a.cui AND a.chunk_id < b.chunk_id
        CROSS JOIN corpus
        GROUP BY a.chunk_id, b.chunk_id
        """
    )
    counts = con.execute(
        f"""
        SELECT (SELECT count(*) FROM {mentions}),
               (SELECT count(DISTINCT chunk_id) FROM {mentions}),
               (SELECT count(DISTINCT cui) FROM {mentions}),
               (SELECT count(*) FROM (SELECT cui FROM {mentions} GROUP BY cui
                                      HAVING count(DISTINCT chunk_id) > {int(max_chunks_per_concept)})),
               (SELECT count(*) FROM {links})
        """
    ).fetchone()
    (stats.mentions, stats.chunks_with_mentions, stats.concepts,
     stats.concepts_over_fan_out_cap, stats.links) = counts
    stats.mentions_by_type = dict(con.execute(
        f"SELECT match_type, count(*) FROM {mentions} GROUP BY match_type ORDER BY 1").fetchall())
