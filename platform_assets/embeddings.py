"""Embedding tables (incremental: only new or changed texts are encoded) and their ANN indexes.

Past one machine: with `MEDGRAPH_EMBEDDING_SHARDS=N` (N > 1) the node and edge tables, the ones a full UMLS makes
too big for one machine (~7M node texts, ~54M triples), are embedded in N shards. `embeddings/<target>_shards`
is partitioned `0..N-1`, one partition per deterministic slice of the rows (md5 of the id modulo N), each its
own lake file; a backfill of its partitions launches one run per shard (`BackfillPolicy.multi_run(1)`), which
the production run launcher (ECS task / Kubernetes job per run, `deploy/`) runs side by side. `embeddings/<target>`
keeps its key, table and downstream lineage and becomes the merge: it checks the shards add up to the current
source and publishes their union atomically (a refused or failed merge leaves the previous table).

Why a setting that swaps definitions, and not shard partitions always present: with N = 1 (the default, what
`make demo` and the tests use) the graph is exactly the unsharded one, with no extra asset for a laptop to
materialize, no partition to pick and the same table as before; with N > 1 each sharded table gains one node,
and everything that reads `embeddings/<target>` (GSRM, the projector, the evaluations) is unchanged. The shard
count shapes the partitions the way `MEDGRAPH_BENCHMARK` shapes the evaluation's. `chunk_embeddings` stays one
step: the corpus is small next to the KG and its KG chunks borrow node vectors.
"""

import dagster as dg

from medgraph.embed.index import VectorIndex
from medgraph.embed.tables import (
    EMBEDDING_SOURCES,
    EmbedStats,
    MergeStats,
    Shard,
    ShardsNotCurrentError,
    embed_shard,
    embed_table,
    embedding_source_sql,
    merge_shards,
)
from medgraph.settings import load_settings
from medgraph.storage import Warehouse
from platform_assets.automation import on_data_version_change, on_data_version_change_once_settled
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
# The tables embedded in shards when MEDGRAPH_EMBEDDING_SHARDS > 1.
SHARDED = ("node_embeddings", "node_description_embeddings", "edge_embeddings")


class EmbeddingConfig(dg.Config):
    relations: list[str] | None = None
    """edge_embeddings only: embed just the edges of these relations (default: all)."""
    sample: str | None = None
    """"K/N": embed just the rows of shard K of N (md5 of the id modulo N, as the shards split them), a bounded
    deterministic slice for a trial run at UMLS size (benchmarks/scale_run.py). The table then lacks the other
    rows: node search misses them, GSRM encodes their triples on the fly and the GAT gets zero features."""

    def source_sql(self, target: str) -> str:
        return embedding_source_sql(target, self.relations, Shard.parse(self.sample) if self.sample else None)


def _table_metadata(store: Warehouse, target: str, stats: EmbedStats | MergeStats) -> dict[str, object]:
    """The metadata of a published table, after building (or loading) its vector index."""
    index = VectorIndex.build_or_load(store.lake, target)
    metadata = stats.as_metadata()
    metadata.update({"index_kind": index.kind, "index_version": index.version,
                     "dagster/row_count": stats.rows, "dagster/table_name": f"embeddings.{target}"})
    return metadata


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
        stats = embed_table(store, config.source_sql(target), target, encoder.load(),
                            id_column=source.id_column,
                            text_column=source.text_column, progress=True,
                            reuse_from=["node_embeddings"] if target == "chunk_embeddings" else ())
        context.log.info(f"{target}: embedded {stats.embedded}, reused {stats.reused}, removed {stats.removed}")
        return dg.MaterializeResult(metadata=_table_metadata(store, target, stats))

    return _embed


def _shard_asset(target: str, shards: int) -> dg.AssetsDefinition:
    @dg.asset(
        key_prefix=["embeddings"],
        name=f"{target}_shards",
        deps=INPUTS[target],
        partitions_def=dg.StaticPartitionsDefinition([str(k) for k in range(shards)]),
        backfill_policy=dg.BackfillPolicy.multi_run(1),  # one run (one ECS task / pod) per shard
        group_name="embeddings",
        kinds={"parquet"},
        code_version="1",
        automation_condition=on_data_version_change(),
        description=f"{DESCRIPTIONS[target]} One partition per shard of {shards} (md5 of the id modulo {shards}), "
        f"each the lake file `embeddings/{target}.shard-<k>-of-{shards}.parquet`; `embeddings/{target}` merges them.",
    )
    def _embed_shard(context: dg.AssetExecutionContext, config: EmbeddingConfig, warehouse: WarehouseResource,
                     encoder: EncoderResource) -> dg.MaterializeResult:
        source = EMBEDDING_SOURCES[target]
        stats = embed_shard(warehouse.get_warehouse(), config.source_sql(target), target,
                            encoder.load(), Shard(int(context.partition_key), shards),
                            id_column=source.id_column, text_column=source.text_column, progress=True)
        return dg.MaterializeResult(metadata={**stats.as_metadata(), "dagster/row_count": stats.rows})

    return _embed_shard


def _merge_asset(target: str, shards: int) -> dg.AssetsDefinition:
    @dg.asset(
        key_prefix=["embeddings"],
        name=target,
        deps=[dg.AssetKey(["embeddings", f"{target}_shards"])],
        group_name="embeddings",
        kinds={"duckdb", "parquet", "faiss"},
        pool="warehouse",
        code_version="1",
        # Waits for every shard of a change: the shards' partitions run as separate runs.
        automation_condition=on_data_version_change_once_settled(),
        description=DESCRIPTIONS[target] + f" The union of its {shards} shards, checked against the current source: "
        f"Parquet in the lake, view `embeddings.{target}`, and a versioned FAISS index file beside it.",
    )
    def _merge(config: EmbeddingConfig, warehouse: WarehouseResource,
               encoder: EncoderResource) -> dg.MaterializeResult:
        store = warehouse.get_warehouse()
        source = EMBEDDING_SOURCES[target]
        try:
            stats = merge_shards(store, config.source_sql(target), target,
                                 encoder.load().encoder_id, shards, id_column=source.id_column,
                                 text_column=source.text_column)
        except ShardsNotCurrentError as error:
            partitions = ", ".join(str(k) for k in error.shards)
            raise dg.Failure(f"{error}: materialize partitions {partitions} of embeddings/{target}_shards "
                             "(with the same config) first") from error
        return dg.MaterializeResult(metadata=_table_metadata(store, target, stats))

    return _merge


def build_embedding_assets(shards: int) -> list[dg.AssetsDefinition]:
    """The embedding assets: one per table, or with `shards` > 1 a shard asset and a merge for each SHARDED table."""
    if shards == 1:
        return [_embedding_asset(target) for target in EMBEDDING_SOURCES]
    assets = []
    for target in EMBEDDING_SOURCES:
        assets += [_shard_asset(target, shards), _merge_asset(target, shards)] if target in SHARDED \
            else [_embedding_asset(target)]
    return assets


embedding_assets = build_embedding_assets(load_settings().embedding_shards)

defs = dg.Definitions(assets=embedding_assets)
