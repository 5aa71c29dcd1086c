"""Embedding tables (incremental: only new or changed texts are encoded) and their ANN indexes."""

import dagster as dg

from medgraph.embed.index import VectorIndex
from medgraph.embed.tables import EMBEDDING_SOURCES, embed_table, embedding_source_sql
from platform_assets.automation import on_data_version_change
from resources import EncoderResource, WarehouseResource

INPUTS = {
    "node_embeddings": [dg.AssetKey(["kg", "kg_node_text"])],
    "node_description_embeddings": [dg.AssetKey(["kg", "kg_node_text"])],
    "edge_embeddings": [dg.AssetKey(["kg", "kg_edges"]), dg.AssetKey(["kg", "kg_nodes"])],
    # After node_embeddings: KG chunks are node texts, whose vectors are borrowed, not recomputed.
    "chunk_embeddings": [dg.AssetKey(["text", "corpus_chunks"]), dg.AssetKey(["embeddings", "node_embeddings"])],
}
DESCRIPTIONS = {
    "node_embeddings": "One vector per KG node text (what `search_nodes` uses).",
    "node_description_embeddings": "One vector per node description without relations (the GAT's node features).",
    "edge_embeddings": "One vector per triple text 'head relation tail' (what A2RAG's GSRM scores).",
    "chunk_embeddings": "One vector per corpus chunk (dense half of hybrid text search).",
}


class EmbeddingConfig(dg.Config):
    relations: list[str] | None = None
    """edge_embeddings only: embed just the edges of these relations (default: all)."""


def _embedding_asset(target: str) -> dg.AssetsDefinition:
    @dg.asset(
        key_prefix=["embeddings"],
        name=target,
        deps=INPUTS[target],
        group_name="embeddings",
        kinds={"duckdb", "parquet", "faiss"},
        pool="warehouse",
        code_version="1",
        automation_condition=on_data_version_change(),
        description=DESCRIPTIONS[target] + " Parquet in the lake, view `embeddings." + target
        + "`, and a versioned FAISS index file beside it.",
    )
    def _embed(context: dg.AssetExecutionContext, config: EmbeddingConfig, warehouse: WarehouseResource,
               encoder: EncoderResource) -> dg.MaterializeResult:
        store = warehouse.get_warehouse()
        source = EMBEDDING_SOURCES[target]
        stats = embed_table(store, embedding_source_sql(target, config.relations), target, encoder.load(),
                            id_column=source.id_column,
                            text_column=source.text_column, progress=True,
                            reuse_from=["node_embeddings"] if target == "chunk_embeddings" else ())
        context.log.info(f"{target}: embedded {stats.embedded}, reused {stats.reused}, removed {stats.removed}")
        index = VectorIndex.build_or_load(store.lake, target)
        metadata = stats.as_metadata()
        metadata.update({"index_kind": index.kind, "index_version": index.version,
                         "dagster/row_count": stats.rows, "dagster/table_name": f"embeddings.{target}"})
        return dg.MaterializeResult(metadata=metadata)

    return _embed


embedding_assets = [_embedding_asset(target) for target in EMBEDDING_SOURCES]

defs = dg.Definitions(assets=embedding_assets)
