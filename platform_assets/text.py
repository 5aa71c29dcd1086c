"""Text corpus (KG node texts + optional user corpora), its BM25 index, and the chunk-concept graph."""

import dagster as dg

from medgraph.text.corpus import build_corpus_chunks
from medgraph.text.mentions import link_chunk_mentions
from resources import WarehouseResource


class CorpusConfig(dg.Config):
    corpus_files: list[str] = []
    """Extra corpora: JSONL or Parquet files with `id`, `title`, `text` (e.g. PubMed abstracts)."""
    include_kg: bool = True
    chunk_tokens: int = 1200
    overlap_tokens: int = 100


@dg.asset(
    key=["text", "corpus_chunks"],
    deps=[dg.AssetKey(["kg", "kg_node_text"])],
    group_name="text",
    kinds={"duckdb", "parquet"},
    pool="warehouse",
    automation_condition=dg.AutomationCondition.eager(),
    code_version="1",
)
def corpus_chunks(context: dg.AssetExecutionContext, config: CorpusConfig,
                  warehouse: WarehouseResource) -> dg.MaterializeResult:
    """Token chunks (default 1200 with 100 overlap) of every KG node text and user document, as
    `text.corpus_chunks`, with its BM25 index (DuckDB fts) rebuilt in the same transaction."""
    stats = build_corpus_chunks(warehouse.open(), config.corpus_files, include_kg=config.include_kg,
                                chunk_tokens=config.chunk_tokens, overlap_tokens=config.overlap_tokens)
    metadata = stats.as_metadata()
    metadata["dagster/row_count"] = stats.chunks
    metadata["dagster/table_name"] = "text.corpus_chunks"
    return dg.MaterializeResult(metadata=metadata)


class MentionsConfig(dg.Config):
    max_chunks_per_concept: int = 50
    """Concepts mentioned in more chunks than this create no chunk-chunk links (no quadratic cliques)."""


@dg.multi_asset(
    specs=[
        dg.AssetSpec(["kg", "kg_chunk_mentions"], deps=[corpus_chunks, dg.AssetKey(["kg", "kg_nodes"])],
                     description="Concepts each chunk mentions (exact and fuzzy name matches, with offsets).",
                     kinds={"duckdb", "parquet"}, group_name="text",
                     automation_condition=dg.AutomationCondition.eager()),
        dg.AssetSpec(["kg", "kg_chunk_links"], deps=[corpus_chunks, dg.AssetKey(["kg", "kg_nodes"])],
                     description="Chunk-chunk edges between chunks that mention a common concept.",
                     kinds={"duckdb", "parquet"}, group_name="text",
                     automation_condition=dg.AutomationCondition.eager()),
    ],
    pool="warehouse",
    code_version="1",
)
def chunk_concept_graph(context: dg.AssetExecutionContext, config: MentionsConfig, warehouse: WarehouseResource):
    """Graph-R1's chunk-entity graph over our KG: chunk -> concept mentions and chunk <-> chunk links."""
    stats = link_chunk_mentions(warehouse.open(), max_chunks_per_concept=config.max_chunks_per_concept)
    metadata = stats.as_metadata()
    yield dg.MaterializeResult(asset_key=["kg", "kg_chunk_mentions"],
                               metadata={**metadata, "dagster/row_count": stats.mentions})
    yield dg.MaterializeResult(asset_key=["kg", "kg_chunk_links"],
                               metadata={"chunk_links": stats.links, "dagster/row_count": stats.links,
                                         "max_chunks_per_concept": stats.max_chunks_per_concept})


defs = dg.Definitions(assets=[corpus_chunks, chunk_concept_graph])
