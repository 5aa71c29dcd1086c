"""Corpus chunks, BM25 and chunk–concept mentions on the tiny KG and small hand-made corpora."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATA, copy_warehouse

from medgraph.storage import Warehouse
from medgraph.text import corpus as corpus_module
from medgraph.text.bm25 import FTS_SCHEMA, Bm25IndexMissing, bm25_search, build_bm25_index, load_fts
from medgraph.text.chunking import load_tokenizer, window_spans
from medgraph.text.corpus import CorpusFile, CorpusFormatError, build_corpus_chunks, read_corpus_file
from medgraph.text.mentions import ConceptDictionary, Mention, TextChunk, link_chunk_mentions

SIMPLE_WORDS = ["the", "cat", "sat", "on", "the", "mat", "with", "a", "dog", "and", "fish", "near", "my", "red",
                "car"]  # one token each


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def text_warehouse(kg_warehouse: Warehouse, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    """The tiny KG with the default corpus_chunks (PubMedQA abstracts, concept definitions), its BM25 index and
    the mention tables. Read-only."""
    warehouse = copy_warehouse(kg_warehouse, tmp_path_factory.mktemp("text_home"))
    build_corpus_chunks(warehouse)
    link_chunk_mentions(warehouse)
    return warehouse


@pytest.fixture
def kg_copy(kg_warehouse: Warehouse, tmp_path: Path) -> Warehouse:
    return copy_warehouse(kg_warehouse, tmp_path / "home")


@pytest.fixture(scope="module")
def node_cui(kg_warehouse: Warehouse):
    with kg_warehouse.connect(read_only=True) as con:
        names = dict(con.execute("SELECT preferred_name, cui FROM kg.kg_nodes").fetchall())
    return names.__getitem__


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def rows(warehouse: Warehouse, sql: str, params: list | None = None) -> list[tuple]:
    with warehouse.connect(read_only=True) as con:
        return con.execute(sql, params or []).fetchall()


# -----------------------------------------------------------------------------
# Chunking

def test_chunks_respect_size_overlap_word_boundaries_and_offsets(tokenizer):
    words = ["Epileptiform", "discharges,", "naïve", "café", "Sjögren’s", "bradycardias", "non-small-cell", "x"]
    document = " ".join(words[i % len(words)] + ("." if i % 11 == 0 else "") for i in range(600))
    encoding = tokenizer.encode(document, add_special_tokens=False)
    spans = window_spans(encoding.offsets, encoding.word_ids, chunk_tokens=50, overlap_tokens=10)

    assert spans[0].start_token == 0 and spans[-1].end_token == len(encoding.ids)
    for span in spans:
        assert 0 < span.n_tokens <= 50
        text = document[span.start_char:span.end_char]
        assert text == text.strip() and len(tokenizer.encode(text, add_special_tokens=False).ids) == span.n_tokens
        for boundary in (span.start_token, span.end_token):  # never inside a word
            assert boundary in (0, len(encoding.ids)) or encoding.word_ids[boundary] != encoding.word_ids[boundary - 1]
    for previous, span in itertools.pairwise(spans):
        overlap = previous.end_token - span.start_token
        assert 10 <= overlap < 10 + 6  # at least the overlap, plus at most the rest of one word
        assert span.start_char < previous.end_char


def test_long_document_splits_into_the_expected_number_of_chunks(tokenizer):
    def chunk_count(n_tokens: int, size: int, overlap: int) -> int:
        document = " ".join(SIMPLE_WORDS[i % len(SIMPLE_WORDS)] for i in range(n_tokens))
        encoding = tokenizer.encode(document, add_special_tokens=False)
        assert len(encoding.ids) == n_tokens
        return len(window_spans(encoding.offsets, encoding.word_ids, size, overlap))

    assert chunk_count(1000, 300, 50) == 1 + math.ceil((1000 - 300) / 250) == 4
    assert chunk_count(300, 300, 50) == 1  # no trailing chunk of overlap alone
    assert chunk_count(301, 300, 50) == 2
    assert chunk_count(3500, 1200, 100) == 1 + math.ceil((3500 - 1200) / 1100) == 4


def test_window_settings_are_checked(tokenizer):
    with pytest.raises(ValueError, match="overlap_tokens"):
        window_spans([(0, 1)], [0], chunk_tokens=100, overlap_tokens=100)


# -----------------------------------------------------------------------------
# Corpus files and the corpus_chunks table

def test_jsonl_and_parquet_corpora_are_chunked_next_to_the_kg_node_texts(kg_copy: Warehouse, tmp_path: Path):
    long_text = " ".join(SIMPLE_WORDS[i % len(SIMPLE_WORDS)] for i in range(2500))
    jsonl = write_jsonl(tmp_path / "abstracts.jsonl", [
        {"id": 1, "title": "Long", "text": long_text},
        {"id": "p2", "text": "Focal motor seizure in a child."},  # no title: allowed
    ])
    parquet = tmp_path / "notes.parquet"
    pq.write_table(pa.table({"id": ["n1", "n2"], "title": ["A", None], "text": ["Bradycardia at rest.", "   "]}), parquet)

    stats = build_corpus_chunks(kg_copy, [jsonl, CorpusFile(parquet, source="clinical")], sources=["kg_node_texts"])

    kg_nodes = rows(kg_copy, "SELECT count(*) FROM kg.kg_node_text")[0][0]
    node_texts = stats.per_source["kg_node_texts"]
    assert (node_texts.documents, node_texts.chunks) == (kg_nodes, kg_nodes)
    assert stats.per_source["abstracts"].chunks == (1 + math.ceil((2500 - 1200) / 1100)) + 1  # long + short doc
    assert (stats.per_source["clinical"].documents, stats.per_source["clinical"].empty_documents) == (2, 1)
    got = rows(kg_copy, "SELECT source, doc_id, chunk_index, title, n_tokens FROM text.corpus_chunks "
                        "WHERE source <> 'kg_node_texts' ORDER BY source, doc_id, chunk_index")
    assert got == [("abstracts", "1", 0, "Long", 1200), ("abstracts", "1", 1, "Long", 1200),
                   ("abstracts", "1", 2, "Long", 300), ("abstracts", "p2", 0, "", 7),
                   ("clinical", "n1", 0, "A", 6)]  # brady ##card ##ia at rest .
    lake_file = kg_copy.lake.table_path("text", "corpus_chunks")
    assert pq.read_table(lake_file).num_rows == stats.chunks == kg_nodes + 5
    assert stats.as_metadata()["chunks_abstracts"] == 4
    assert not list(lake_file.parent.glob(".*tmp*"))


def test_chunk_text_is_the_document_substring_and_ids_are_stable(kg_copy: Warehouse, tmp_path: Path):
    text = "  Sjögren’s syndrome — naïve café.  " + " ".join(["epileptiform discharges"] * 700)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"id": "d", "title": "t", "text": text}])
    build_corpus_chunks(kg_copy, [jsonl], sources=(), chunk_tokens=200, overlap_tokens=20)
    first = rows(kg_copy, "SELECT chunk_id, text, start_char, end_char FROM text.corpus_chunks ORDER BY chunk_index")
    assert len(first) > 5
    assert all(chunk == text[start:end] for _, chunk, start, end in first)
    assert first[0][2] == 2  # leading whitespace is not part of a chunk
    build_corpus_chunks(kg_copy, [jsonl], sources=(), chunk_tokens=200, overlap_tokens=20)
    assert rows(kg_copy, "SELECT chunk_id, text, start_char, end_char FROM text.corpus_chunks "
                         "ORDER BY chunk_index") == first


@pytest.mark.parametrize("line, message", [
    ("{not json", r"docs\.jsonl:3: expected a JSON object, found invalid JSON"),
    ('["a", "b"]', r'docs\.jsonl:3: expected a JSON object with "id" and "text", found list'),
    ('{"id": "x3", "title": "t"}', r'docs\.jsonl:3: expected key "text" \(a string\), found nothing'),
    ('{"title": "t", "text": "x"}', r'docs\.jsonl:3: expected key "id" \(a non-empty string or integer\)'),
    ('{"id": "x1", "text": "again"}', r"docs\.jsonl:3: duplicate id 'x1'"),
])
def test_malformed_jsonl_line_names_file_and_line_and_keeps_the_table(kg_copy: Warehouse, tmp_path: Path,
                                                                       line: str, message: str):
    build_corpus_chunks(kg_copy)
    before = rows(kg_copy, "SELECT count(*), sum(hash(chunk_id)) FROM text.corpus_chunks")
    jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"id": "x1", "text": "one"}, "", line])
    with pytest.raises(CorpusFormatError, match=message):
        build_corpus_chunks(kg_copy, [jsonl])
    assert rows(kg_copy, "SELECT count(*), sum(hash(chunk_id)) FROM text.corpus_chunks") == before


def test_malformed_parquet_names_the_row_or_the_missing_column(tmp_path: Path):
    bad_row = tmp_path / "bad_row.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["x", "y", None]}), bad_row)
    with pytest.raises(CorpusFormatError, match=r'bad_row\.parquet:row 3: expected column "text" \(a string\)'):
        list(read_corpus_file(bad_row))
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), no_text)
    with pytest.raises(CorpusFormatError, match=r"no_text\.parquet: expected columns id, title \(optional\), text; "
                                                r"missing text"):
        list(read_corpus_file(no_text))
    csv = tmp_path / "notes.csv"
    csv.write_text("id,text\n", encoding="utf-8")
    with pytest.raises(CorpusFormatError, match=r"notes\.csv: expected a \.jsonl"):
        list(read_corpus_file(csv))


# -----------------------------------------------------------------------------
# BM25

def test_bm25_finds_a_seizure_concept_for_seizure(text_warehouse: Warehouse):
    [hits] = bm25_search(text_warehouse, ["seizure"], k=10)
    assert len(hits) == 10 and hits == sorted(hits, key=lambda h: (-h[1], h[0]))
    titles = rows(text_warehouse, "SELECT title FROM text.corpus_chunks WHERE list_contains(?, chunk_id)",
                  [[chunk for chunk, _ in hits]])
    assert any("seizure" in t.lower() or "epilep" in t.lower() for (t,) in titles)


def test_empty_and_punctuation_queries_return_nothing_in_a_batch(text_warehouse: Warehouse):
    queries = ["", "   ", "?!...", "'\"\\", "the of and", "focal seizure's \"onset\" (motor)", "bradycardia"]
    results = bm25_search(text_warehouse, queries, k=5)
    assert results[:5] == [[], [], [], [], []]
    assert len(results[5]) == len(results[6]) == 5
    assert results[5:] == [bm25_search(text_warehouse, [q], k=5)[0] for q in queries[5:]]


def test_batched_scores_equal_the_extension_macro(text_warehouse: Warehouse):
    query = "hypoglycemic seizures in diabetes"
    [hits] = bm25_search(text_warehouse, [query], k=10)
    with text_warehouse.connect(read_only=True) as con:
        load_fts(con)
        expected = con.execute(
            f"SELECT chunk_id, {FTS_SCHEMA}.match_bm25(chunk_id, ?) AS score FROM text.corpus_chunks "
            "WHERE score IS NOT NULL ORDER BY score DESC, chunk_id LIMIT 10", [query]).fetchall()
    assert [c for c, _ in hits] == [c for c, _ in expected]
    assert [s for _, s in hits] == pytest.approx([s for _, s in expected])


def test_search_without_an_index_says_how_to_build_it(kg_warehouse: Warehouse):
    with pytest.raises(Bm25IndexMissing, match="build_corpus_chunks"):
        bm25_search(kg_warehouse, ["seizure"])


def test_failed_rebuild_keeps_the_previous_table_and_index(kg_copy: Warehouse, tmp_path: Path, monkeypatch):
    build_corpus_chunks(kg_copy)
    lake_file = kg_copy.lake.table_path("text", "corpus_chunks")
    before_bytes = lake_file.read_bytes()
    before_rows = rows(kg_copy, "SELECT count(*) FROM text.corpus_chunks")
    before_hits = bm25_search(kg_copy, ["seizure", "bradycardia"], k=5)

    def index_fails(con):
        raise RuntimeError("index build failed")

    monkeypatch.setattr(corpus_module, "create_bm25_index", index_fails)
    extra = write_jsonl(tmp_path / "more.jsonl", [{"id": "s", "text": "seizure seizure seizure"}])
    with pytest.raises(RuntimeError, match="index build failed"):
        build_corpus_chunks(kg_copy, [extra])

    assert rows(kg_copy, "SELECT count(*) FROM text.corpus_chunks") == before_rows
    assert bm25_search(kg_copy, ["seizure", "bradycardia"], k=5) == before_hits
    assert lake_file.read_bytes() == before_bytes
    assert not list(lake_file.parent.glob(".*tmp*"))
    monkeypatch.undo()
    assert build_bm25_index(kg_copy).chunks == before_rows[0][0]


def test_pubmedqa_abstracts_are_found_by_their_questions(kg_copy: Warehouse, tmp_path: Path):
    source = SHARED_DATA / "pubmedqa" / "pqal_dev.json"
    if not source.is_file():
        pytest.skip(f"shared PubMedQA data not present at {source}")
    items = json.loads(source.read_text(encoding="utf-8"))
    jsonl = write_jsonl(tmp_path / "pqal_dev.jsonl", [
        {"id": pmid, "title": "", "text": "\n\n".join([*item["CONTEXTS"], item["LONG_ANSWER"]])}
        for pmid, item in items.items()])
    stats = build_corpus_chunks(kg_copy, [jsonl], sources=())
    assert stats.documents == len(items) == 500

    hits = bm25_search(kg_copy, [item["QUESTION"] for item in items.values()], k=10)
    doc_of = dict(rows(kg_copy, "SELECT chunk_id, doc_id FROM text.corpus_chunks"))
    found = sum(any(doc_of[chunk] == pmid for chunk, _ in h) for pmid, h in zip(items, hits))
    assert found >= 0.95 * len(items)


# -----------------------------------------------------------------------------
# Mentions and chunk links

def test_chunk_mentioning_two_concepts_links_both_with_offsets(kg_warehouse: Warehouse, node_cui):
    dictionary = ConceptDictionary.from_warehouse(kg_warehouse)
    text = "A boy with Focal motor seizure; later, bradycardia at rest."
    mentions = dictionary([TextChunk("c1", "", text)])
    got = {(m.cui, m.mention, m.match_type, m.score, m.start_char, m.end_char) for m in mentions}
    assert got == {
        (node_cui("Focal motor seizure"), "Focal motor seizure", "exact", 1.0, 11, 30),
        (node_cui("Bradycardia"), "bradycardia", "exact", 1.0, 39, 50),
    }
    assert all(text[m.start_char:m.end_char] == m.mention for m in mentions)


def test_plural_and_joined_hyphen_variants_match_fuzzily(kg_warehouse: Warehouse, node_cui):
    dictionary = ConceptDictionary.from_warehouse(kg_warehouse)
    [plural] = dictionary([TextChunk("c1", "", "Recurrent bradycardias were recorded.")])
    assert (plural.cui, plural.mention, plural.match_type) == (node_cui("Bradycardia"), "bradycardias", "fuzzy")
    assert 0.9 < plural.score < 1.0
    toy = ConceptDictionary.from_names([("C1", "X-ray"), ("C2", "Seizure (finding)")])
    found = toy([TextChunk("c2", "", "An xray after the seizure; then an X-ray.")])
    assert [(m.cui, m.mention, m.match_type) for m in found] == [
        ("C1", "xray", "fuzzy"), ("C2", "seizure", "exact"), ("C1", "X-ray", "exact")]


def test_short_stop_word_ambiguous_and_acronym_names(kg_warehouse: Warehouse):
    toy = ConceptDictionary.from_names(
        [("C1", "Was"), ("C2", "ab"), ("C3", "Cold"), ("C4", "cold"), ("C5", "COPD"), ("C6", "heart disease")],
        max_concepts_per_name=1)
    assert toy.skipped == {"stop_words": 1, "too_short": 1, "ambiguous": 1}
    found = toy([TextChunk("c", "", "It was cold. COPD and copd. The heart. Disease; heart  disease")])
    assert [(m.cui, m.mention) for m in found] == [("C5", "COPD"), ("C6", "heart  disease")]


def test_chunk_links_respect_the_fan_out_cap(kg_copy: Warehouse, tmp_path: Path, node_cui):
    seizure, brady = node_cui("Focal motor seizure"), node_cui("Bradycardia")
    docs = write_jsonl(tmp_path / "cases.jsonl", [
        {"id": "a", "text": "Focal motor seizure and bradycardia."},
        {"id": "b", "text": "Bradycardia with a focal motor seizure."},
        {"id": "c", "text": "Bradycardia only."},
    ])
    build_corpus_chunks(kg_copy, [docs], sources=())
    chunk = dict(rows(kg_copy, "SELECT doc_id, chunk_id FROM text.corpus_chunks"))

    stats = link_chunk_mentions(kg_copy, max_chunks_per_concept=2)  # bradycardia is in 3 chunks: no links
    assert (stats.concepts, stats.concepts_over_fan_out_cap, stats.links) == (2, 1, 1)
    links = rows(kg_copy, "SELECT chunk_a, chunk_b, shared_concepts FROM kg.kg_chunk_links")
    assert links == [(*sorted([chunk["a"], chunk["b"]]), [seizure])]

    link_chunk_mentions(kg_copy, max_chunks_per_concept=3)
    links = rows(kg_copy, "SELECT chunk_a, chunk_b, shared_concepts, weight FROM kg.kg_chunk_links "
                          "ORDER BY len(shared_concepts) DESC, chunk_a, chunk_b")
    assert len(links) == 3 and links[0][2] == sorted([seizure, brady])
    assert links[0][3] == pytest.approx(math.log(1 + 3 / 2) + math.log(1 + 3 / 3))
    lake_links = pq.read_table(kg_copy.lake.table_path("kg", "kg_chunk_links"))
    assert lake_links.num_rows == 3


def test_extract_hook_adds_mentions_and_drops_unknown_concepts(kg_copy: Warehouse, tmp_path: Path, node_cui):
    docs = write_jsonl(tmp_path / "cases.jsonl", [{"id": "a", "text": "Bradycardia and a slow pulse."}])
    build_corpus_chunks(kg_copy, [docs], sources=())
    dictionary = ConceptDictionary.from_warehouse(kg_copy)

    def with_llm(chunks):
        llm = [Mention(c.chunk_id, node_cui("Bradycardia"), "slow pulse", "llm", 0.7, 18, 28) for c in chunks]
        llm += [Mention(c.chunk_id, "C_NOT_IN_KG", "pulse", "llm", 0.9, 23, 28) for c in chunks]
        return [*dictionary(chunks), *llm]

    stats = link_chunk_mentions(kg_copy, extract=with_llm)
    assert stats.mentions_by_type == {"exact": 1, "llm": 1} and stats.mentions_dropped_unknown_cui == 1
    assert rows(kg_copy, "SELECT mention, match_type FROM kg.kg_chunk_mentions ORDER BY start_char") == [
        ("Bradycardia", "exact"), ("slow pulse", "llm")]


def test_kg_mentions_have_exact_offsets_and_match_the_lake(text_warehouse: Warehouse):
    bad = rows(text_warehouse, """
        SELECT count(*) FROM kg.kg_chunk_mentions AS m JOIN text.corpus_chunks AS c USING (chunk_id)
        WHERE substr(c.text, m.start_char + 1, m.end_char - m.start_char) <> m.mention""")
    assert bad == [(0,)]
    # Every definition's chunk mentions the concept it defines (its text starts with the preferred name).
    unlinked, definitions = rows(text_warehouse, """
        SELECT count(*) FILTER (WHERE NOT EXISTS (
            SELECT 1 FROM kg.kg_chunk_mentions AS m WHERE m.chunk_id = c.chunk_id AND m.cui = c.doc_id)), count(*)
        FROM text.corpus_chunks AS c WHERE c.source = 'definitions'""")[0]
    assert definitions > 0 and unlinked < 0.02 * definitions
    for table in ("kg_chunk_mentions", "kg_chunk_links"):
        lake = pq.read_table(text_warehouse.lake.table_path("kg", table)).num_rows
        assert lake == rows(text_warehouse, f"SELECT count(*) FROM kg.{table}")[0][0] > 0
