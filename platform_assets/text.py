"""Text corpus (PubMedQA abstracts, concept definitions, optional user corpora), its BM25 index, and the
chunk-concept graph."""

import dagster as dg

from medgraph.text.corpus import DEFAULT_SOURCES, build_corpus_chunks, mention_coverage
from medgraph.text.mentions import link_chunk_mentions
from platform_assets.automation import on_data_version_change
from resources import WarehouseResource


class CorpusConfig(dg.Config):
    sources: list[str] = list(DEFAULT_SOURCES)
    """Built-in sources: `pubmedqa` (the packaged PQA-L abstracts, MIT), `definitions` (one document per
    concept with its UMLS definitions) and, opt-in, `kg_node_texts` (node texts with verbalized relations)."""
    corpus_files: list[str] = []
    """Extra corpora: JSONL or Parquet files with `id`, `title`, `text` (e.g. PubMed abstracts)."""
    chunk_tokens: int = 1200
    overlap_tokens: int = 100


@dg.asset(
    key=["text", "corpus_chunks"],
    deps=[dg.AssetKey(["kg", "kg_nodes"]), dg.AssetKey(["kg", "kg_node_text"])],
    group_name="text",
    kinds={"duckdb", "parquet"},
    pool="warehouse",
    automation_condition=on_data_version_change(),
    code_version="2",
)
def corpus_chunks(context: dg.AssetExecutionContext, config: CorpusConfig,
                  warehouse: WarehouseResource) -> dg.MaterializeResult:
    """Token chunks (default 1200 with 100 overlap) of the PubMedQA abstracts, concept definitions and user
    documents, as `text.corpus_chunks`, with its BM25 index (DuckDB fts) rebuilt in the same transaction."""
    stats = build_corpus_chunks(warehouse.get_warehouse(), config.corpus_files, sources=config.sources,
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
                     automation_condition=on_data_version_change()),
        dg.AssetSpec(["kg", "kg_chunk_links"], deps=[corpus_chunks, dg.AssetKey(["kg", "kg_nodes"])],
                     description="Chunk-chunk edges between chunks that mention a common concept.",
                     kinds={"duckdb", "parquet"}, group_name="text",
                     automation_condition=on_data_version_change()),
    ],
    pool="warehouse",
    code_version="2",
)
def chunk_concept_graph(context: dg.AssetExecutionContext, config: MentionsConfig, warehouse: WarehouseResource):
    """Graph-R1's chunk-entity graph over our KG: chunk -> concept mentions and chunk <-> chunk links."""
    store = warehouse.get_warehouse()
    stats = link_chunk_mentions(store, max_chunks_per_concept=config.max_chunks_per_concept)
    metadata = stats.as_metadata()
    metadata["chunks_with_mentions_share"] = round(stats.chunks_with_mentions / max(stats.chunks, 1), 4)
    for source, (mentioning, total) in mention_coverage(store).items():
        metadata[f"chunks_with_mentions_{source}"] = f"{mentioning} of {total} ({mentioning / total:.1%})"
    yield dg.MaterializeResult(asset_key=["kg", "kg_chunk_mentions"],
                               metadata={**metadata, "dagster/row_count": stats.mentions})
    yield dg.MaterializeResult(asset_key=["kg", "kg_chunk_links"],
                               metadata={"chunk_links": stats.links, "dagster/row_count": stats.links,
                                         "max_chunks_per_concept": stats.max_chunks_per_concept})


defs = dg.Definitions(assets=[corpus_chunks, chunk_concept_graph])
