"""KG-derived questions with verifiable answers: the embedded benchmark and the policy's training data."""

from pathlib import Path

import dagster as dg

from medgraph.kg.qa import generate_qa_items, gold_pairs_in_two_splits
from platform_assets.automation import on_data_version_change
from resources import WarehouseResource

KG_INPUTS = [dg.AssetKey(["kg", "kg_nodes"]), dg.AssetKey(["kg", "kg_edges"])]


class QaConfig(dg.Config):
    per_type: int = 1000
    """Questions per type (mc, yesno, short_1hop, short_2hop), at most."""
    seed: int = 0


@dg.asset(
    key=["qa", "qa_items"],
    deps=KG_INPUTS,
    group_name="qa",
    kinds={"duckdb", "parquet", "json"},
    pool="warehouse",
    automation_condition=on_data_version_change(),
    code_version="2",
)
def qa_items(context: dg.AssetExecutionContext, config: QaConfig, warehouse: WarehouseResource) -> dg.MaterializeResult:
    """Multiple-choice, yes/no and 1-/2-hop short-answer questions read off `kg.kg_edges`, each with
    its gold path; split train/validation/test by fact (no unordered gold concept pair in two splits).
    Table `qa.qa_items` plus MIRAGE files `$MEDGRAPH_HOME/qa/qa_items.<split>.json`."""
    store = warehouse.get_warehouse()
    stats = generate_qa_items(store, Path(warehouse.home) / "qa", seed=config.seed, per_type=config.per_type)
    metadata = stats.as_metadata()
    metadata["dagster/table_name"] = "qa.qa_items"
    metadata["dagster/row_count"] = stats.items
    return dg.MaterializeResult(metadata=metadata)


@dg.asset_check(asset=qa_items, blocking=True,
                description="No unordered gold concept pair occurs in two splits (train/validation/test).")
def no_gold_pair_in_two_splits(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    leaked = gold_pairs_in_two_splits(warehouse.get_warehouse())
    return dg.AssetCheckResult(passed=not leaked, metadata={"leaked_pairs": len(leaked),
                                                            "examples": str(leaked[:5])})


defs = dg.Definitions(assets=[qa_items], asset_checks=[no_gold_pair_in_two_splits])
