"""GSRM tuned and measured without the LLM: tau/K/N chosen on validation, Recall@10 by iteration on test."""

from pathlib import Path

import dagster as dg

from medgraph.eval.evaluate import write_partition
from medgraph.eval.gsrm import (
    DEFAULT_ITERATIONS,
    DEFAULT_TAUS,
    DEFAULT_TOP_NS,
    RECALL_ITEMS_TABLE,
    RECALL_TABLE,
    choose_gsrm_params,
    gsrm_recall_by_dataset,
    gsrm_recall_table_rows,
    log_sweep,
    measurable_items,
    pooled_points,
    read_gsrm_params,
    recall_markdown,
    sweep_gsrm_by_dataset,
    sweep_markdown,
    write_gsrm_params,
)
from medgraph.home import HomeLayout
from medgraph.methods.a2rag import A2RagConfig
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.item import QaItem
from medgraph.qa.mirage import load_mirage
from medgraph.retrieval import Retriever
from platform_assets.automation import on_data_version_change
from resources import EncoderResource, MlflowResource, WarehouseResource

EMBEDDINGS = [dg.AssetKey(["embeddings", "edge_embeddings"]), dg.AssetKey(["embeddings", "node_embeddings"])]
GSRM_PARAMS = dg.AssetKey(["models", "gsrm_params"])
PARAMS_INPUTS = [dg.AssetKey(["qa", "qa_items"]), *EMBEDDINGS]


class GsrmSweepConfig(dg.Config):
    taus: list[float] = list(DEFAULT_TAUS)
    iterations: list[int] = list(DEFAULT_ITERATIONS)
    """Values of K; one GSRM run per tau at the largest K gives them all."""
    top_ns: list[int] = list(DEFAULT_TOP_NS)
    limit: int | None = None
    """Validation items with gold pairs to use (taken in turn from each dataset and hop count); None: all."""
    max_triples_per_relation: int | None = A2RagConfig.max_triples_per_relation
    """A2RAG's hub guard per (entity, relation), so the sweep measures the subgraphs A2RAG builds."""
    batch_size: int = 64


def _items(home: Path, split: str, limit: int | None = None) -> list[QaItem]:
    """The split's items with gold pairs (1- and 2-hop); `limit` of them, in turn from each (dataset, hops)."""
    return measurable_items(load_mirage(HomeLayout(home).qa_split(split)), limit)


@dg.asset(key=GSRM_PARAMS.path, deps=PARAMS_INPUTS, group_name="models", kinds={"mlflow", "json"},
          pool="gpu", code_version="1", automation_condition=None)  # weekly_retraining: see automation.py
def gsrm_params(context: dg.AssetExecutionContext, config: GsrmSweepConfig, warehouse: WarehouseResource,
                encoder: EncoderResource, mlflow_tracking: MlflowResource) -> dg.MaterializeResult:
    """GSRM's tau, K and N chosen on the validation split by Recall@10 of the ranked triple list
    (`medgraph.eval.gsrm.choose_gsrm_params`) for each dataset apart (A2RAG uses its item's dataset's), and
    over all datasets pooled (for items of another dataset), written to `$MEDGRAPH_HOME/models/gsrm_params.json`."""
    home = Path(warehouse.home)
    items = _items(home, "validation", config.limit)
    with Retriever(warehouse.get_warehouse(), encoder.load()) as retriever, \
            mlflow_tracking.start_asset_run(context, PARAMS_INPUTS) as run:
        sweeps = sweep_gsrm_by_dataset(KnowledgeTools.with_home_cache(retriever, home), items, config.taus,
                                    config.iterations, config.top_ns, config.max_triples_per_relation,
                                    config.batch_size, progress=context.log.info)
        choices = {kind: choose_gsrm_params(sweep.points) for kind, sweep in sweeps.items()}
        default = choose_gsrm_params(pooled_points(sweeps))
        path = write_gsrm_params(home, default, sweeps, choices)
        log_sweep(sweeps, choices, default, path)
        run_id = run.info.run_id
    chosen = "; ".join(f"{kind}: tau={c.tau:g} K={c.iterations} N={c.top_n} (n={c.n})" for kind, c in choices.items())
    context.log.info(f"GSRM per dataset: {chosen}; pooled tau={default.tau} K={default.iterations} N={default.top_n}")
    return dg.MaterializeResult(
        metadata={"tau": default.tau, "iterations": default.iterations, "top_n": default.top_n,
                  "recall_at10": default.recall_at10, "recall_at_n": default.recall_at_n, "items": default.n,
                  "by_dataset": chosen, "rule": default.rule, "note": default.note,
                  "sweep": dg.MetadataValue.md(sweep_markdown(sweeps, choices)),
                  "seconds": round(sum(s.seconds for s in sweeps.values()), 1),
                  "path": dg.MetadataValue.path(str(path)), "mlflow_run_id": run_id},
        # Downstream re-runs only when a choice changes, not on every sweep.
        data_version=dg.DataVersion(f"tau={default.tau:g},K={default.iterations},N={default.top_n};"
                                    + ";".join(f"{k}={c.tau:g}/{c.iterations}/{c.top_n}" for k, c in choices.items())),
    )


class GsrmRecallConfig(dg.Config):
    min_iterations: int = 3
    """Report k = 0..max(K, this): k = 0..3 are always there (the seed's claims: a gain at K=2, flat at K=3)."""
    limit: int | None = None
    """Test items with gold pairs to measure (taken in turn from each dataset and hop count); None: every one."""
    batch_size: int = 64


@dg.asset(key=["eval", "gsrm_recall"], deps=[GSRM_PARAMS, dg.AssetKey(["qa", "qa_items"]), *EMBEDDINGS],
          group_name="evaluation", kinds={"duckdb", "parquet"}, pool="gpu", code_version="1",
          automation_condition=on_data_version_change())
def gsrm_recall(context: dg.AssetExecutionContext, config: GsrmRecallConfig, warehouse: WarehouseResource,
                encoder: EncoderResource) -> dg.MaterializeResult:
    """Recall@10 and Recall@N of GSRM's ranked list for k = 0..max(K, 3) over every test item with gold
    pairs, each dataset with its tuned tau, K and N: tables `eval.gsrm_recall` (means, s.e., n per
    dataset and hop count, i.e. per type) and `eval.gsrm_recall_items`."""
    home = Path(warehouse.home)
    params = read_gsrm_params(home)
    if params is None:
        raise dg.Failure("no $MEDGRAPH_HOME/models/gsrm_params.json: materialize models/gsrm_params first")
    items = _items(home, "test", config.limit)
    store = warehouse.get_warehouse()
    with Retriever(store, encoder.load()) as retriever:
        curves = gsrm_recall_by_dataset(KnowledgeTools.with_home_cache(retriever, home), items, params,
                                     config.min_iterations, config.batch_size, progress=context.log.info)
    rows, item_rows = gsrm_recall_table_rows(curves)
    write_partition(store, RECALL_TABLE, "test", rows)
    write_partition(store, RECALL_ITEMS_TABLE, "test", item_rows)
    return dg.MaterializeResult(metadata={
        "recall": dg.MetadataValue.md(recall_markdown(rows)), "items": len(curves),
        "tau": float(params["tau"]), "top_n": int(params["top_n"]), "iterations_tuned": int(params["iterations"]),
        "table": f"eval.{RECALL_TABLE}", "items_table": f"eval.{RECALL_ITEMS_TABLE}"})


defs = dg.Definitions(assets=[gsrm_params, gsrm_recall])
