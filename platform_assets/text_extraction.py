"""Opt-in: n-ary relations extracted from corpus chunks by the configured LLM (Graph-R1's text hyperedges).

Not part of `make demo` (its selection leaves out the group `text_extraction`): with the demo's tiny
LLM the asset skips itself and says so. Run it with a capable model, e.g.
MEDGRAPH_LLM=openai:<model>@http://host:8000/v1 and
`dg launch -m definitions --assets 'group:text_extraction'`.
"""

import dagster as dg

from medgraph.text.extraction import TINY_LLMS, extract_chunk_hyperedges
from resources import LlmResource, WarehouseResource


class ChunkHyperedgesConfig(dg.Config):
    batch_chunks: int = 16
    """Chunks per batched LLM call."""
    max_chunks: int | None = None
    """Chunks to extract in this run (None: all not yet done by this model); a later run resumes."""
    max_new_tokens: int = 512
    prompt_usd_per_1k_tokens: float = 0.0
    completion_usd_per_1k_tokens: float = 0.0
    """Prices for the cost estimate (0: a self-hosted model)."""


@dg.asset(
    key=["text", "chunk_hyperedges"],
    deps=[dg.AssetKey(["text", "corpus_chunks"]), dg.AssetKey(["kg", "kg_nodes"])],
    group_name="text_extraction",
    kinds={"duckdb", "parquet"},
    pool="gpu",
    code_version="1",
)
def chunk_hyperedges(context: dg.AssetExecutionContext, config: ChunkHyperedgesConfig, warehouse: WarehouseResource,
                     llm: LlmResource) -> dg.MaterializeResult:
    """`text.chunk_hyperedges(hyperedge_id, chunk_id, relation_text, entities, cuis, model)`: facts the LLM
    reads in each chunk, over the KG concepts their entities name; resumable, tokens and cost recorded."""
    if llm.spec in TINY_LLMS:  # decided before loading the model
        message = f"skipped: the configured LLM {llm.spec!r} is the tiny default; set MEDGRAPH_LLM to a capable model"
        context.log.warning(message)
        return dg.MaterializeResult(metadata={"skipped": True, "skipped_reason": message})
    stats = extract_chunk_hyperedges(
        warehouse.get_warehouse(), llm.load(), batch_chunks=config.batch_chunks, max_chunks=config.max_chunks,
        max_new_tokens=config.max_new_tokens, prompt_usd_per_1k=config.prompt_usd_per_1k_tokens,
        completion_usd_per_1k=config.completion_usd_per_1k_tokens)
    context.log.info(f"chunk hyperedges: {stats.as_metadata()}")
    return dg.MaterializeResult(metadata={**stats.as_metadata(), "skipped": stats.skipped_reason is not None,
                                          "dagster/row_count": stats.hyperedges_in_table,
                                          "dagster/table_name": "text.chunk_hyperedges"})


defs = dg.Definitions(assets=[chunk_hyperedges])
