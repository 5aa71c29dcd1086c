"""KG-derived questions with verifiable answers: the embedded benchmark and the policy's training data."""


import dagster as dg

from medgraph.kg.shortcuts import (
    MARGIN,
    check_shortcuts,
    measure_shortcuts,
    read_shortcuts,
    shortcuts_markdown,
)
from medgraph.qa.generate import generate_qa_items
from medgraph.qa.table import gold_pairs_in_two_splits
from platform_assets.automation import on_data_version_change
from resources import WarehouseResource

KG_INPUTS = [dg.AssetKey(["kg", "kg_nodes"]), dg.AssetKey(["kg", "kg_edges"])]


class QaConfig(dg.Config):
    per_type: int = 1000
    """Questions per type (mc, mc_2hop, yesno, short_1hop, short_2hop), at most."""
    seed: int = 0


@dg.asset(
    key=["qa", "qa_items"],
    deps=KG_INPUTS,
    group_name="qa",
    kinds={"duckdb", "parquet", "json"},
    pool="warehouse",
    automation_condition=on_data_version_change(),
    code_version="4",
)
def qa_items(context: dg.AssetExecutionContext, config: QaConfig, warehouse: WarehouseResource) -> dg.MaterializeResult:
    """Multiple-choice, yes/no and 1-/2-hop short-answer questions read off `kg.kg_edges`, each with
    its gold path; split train/validation/test by fact (no unordered gold concept pair in two splits).
    Table `qa.qa_items` plus MIRAGE files `$MEDGRAPH_HOME/qa/qa_items.<split>.json`; the no-LLM shortcut
    baselines and the relation-aware oracle of every dataset and split in `qa.qa_shortcuts`."""
    store = warehouse.get_warehouse()
    stats = generate_qa_items(store, warehouse.layout.qa, seed=config.seed, per_type=config.per_type)
    shortcuts = measure_shortcuts(store)
    metadata = stats.as_metadata()
    metadata["shortcuts_test"] = dg.MetadataValue.md(shortcuts_markdown(shortcuts))
    metadata["dagster/table_name"] = "qa.qa_items"
    metadata["dagster/row_count"] = stats.items
    return dg.MaterializeResult(metadata=metadata)


@dg.asset_check(asset=qa_items, blocking=True,
                description="No unordered gold concept pair occurs in two splits (train/validation/test).")
def no_gold_pair_in_two_splits(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    leaked = gold_pairs_in_two_splits(warehouse.get_warehouse())
    return dg.AssetCheckResult(passed=not leaked, metadata={"leaked_pairs": len(leaked),
                                                            "examples": str(leaked[:5])})


@dg.asset_check(asset=qa_items, blocking=True,
                description=f"On each test split no no-LLM shortcut (adjacency, majority, word overlap, semantic "
                            f"type) beats chance by more than {MARGIN:.2f}: the questions need retrieval.")
def no_shortcut_beats_chance(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    rows = read_shortcuts(warehouse.get_warehouse())
    failures = check_shortcuts(rows) if rows else ["qa.qa_shortcuts is missing: materialize qa/qa_items"]
    return dg.AssetCheckResult(passed=not failures, description="; ".join(failures) or "every shortcut within chance",
                               metadata={"shortcuts_test": dg.MetadataValue.md(shortcuts_markdown(rows))})


defs = dg.Definitions(assets=[qa_items], asset_checks=[no_gold_pair_in_two_splits, no_shortcut_beats_chance])
