"""When assets re-materialize by themselves (declarative automation, `default_automation_condition_sensor`).

Data and evaluation assets follow *data versions*, not materializations: `on_data_version_change()` requests an
asset when a dependency's data version differs from the one it had at the previous tick, and then the whole
chain below it in the same tick (as `eager()` does). A re-materialization that reproduces the same data version
(`umls/mrdef` ingested again from an unchanged release) requests nothing downstream.

Where data versions come from: `umls_release` is observed with a content fingerprint (by `umls_release_sensor`
when it requests ingestion, or "Observe" in the UI); every asset that returns no data version of its own gets
Dagster's logical version, a hash of its code version and its inputs' data versions. So versions change exactly
when the release content or an asset's code version changes, and a change propagates down the lineage.

GPU model assets (group `models`: `gat_model`, `hiim_projector`, `gsrm_params`, `graph_r1_sft`,
`graph_r1_policy`) have no automation condition: the `weekly_retraining` schedule (jobs/) retrains them. Why the
schedule and not their inputs' data versions: a retraining holds the one GPU slot for hours, and almost every data
change (a release, a corpus, a changed dbt model) reaches their inputs, so following data versions would retrain
all five after each change and make the re-evaluations people wait for queue behind them; retraining is not
needed for correctness (the evaluations load the champions by alias), a champion moves only when the new model
is better, and `champion_sensor` re-evaluates every method when one moves. So data changes re-evaluate at once
with the current champions, and the schedule batches a week's changes into one retraining at a quiet hour.
"""

from collections.abc import Callable, Sequence

import dagster as dg

AC = dg.AutomationCondition


def any_deps_data_version_changed() -> dg.AutomationCondition:
    """A dependency has a new data version since the previous tick (ignoring one produced by a run that also
    targeted this asset, which then already used it), or will be requested on this tick."""
    changed = (AC.data_version_changed() & ~AC.executed_with_root_target()).with_label(
        "data_version_changed_without_root")
    return AC.any_deps_match(changed | AC.will_be_requested()).with_label("any_deps_data_version_changed")


def on_data_version_change() -> dg.AutomationCondition:
    """`eager()` with "a dependency updated" replaced by "a dependency's data version changed": requests the asset
    (or the latest of its partitions that are newly missing, e.g. a new benchmark dataset) once per change, when no
    dependency is missing or in progress and the asset is not in progress itself."""
    return (
        (AC.newly_missing() | any_deps_data_version_changed()).since_last_handled()
        & ~AC.any_deps_missing()
        & ~AC.any_deps_in_progress()
        & ~AC.in_progress()
    ).with_label("on_data_version_change")


def on_data_version_change_once_settled() -> dg.AutomationCondition:
    """`on_data_version_change()` for an asset over partitioned ones (the report over the evaluations), held back
    while a change is still on its way through its dependencies' dependencies: partitions of another partitioning
    run in a later tick, so without the wait the report would run once before the evaluations and once after."""
    return (on_data_version_change() & ~AC.any_deps_match(any_deps_data_version_changed())).with_label(
        "on_data_version_change_once_settled")


def gpu_model_asset(name: str, deps: Sequence[dg.AssetKey], code_version: str) -> Callable[..., dg.AssetsDefinition]:
    """The decorator of a GPU model asset `models/<name>`: group `models`, kinds pytorch and mlflow, the one slot of
    the `gpu` pool, the accelerator tag, and no automation condition (retrained by the `weekly_retraining`
    schedule, see above)."""
    return dg.asset(
        key=["models", name],
        deps=deps,
        group_name="models",
        kinds={"pytorch", "mlflow"},
        pool="gpu",
        code_version=code_version,
        tags={"medgraph/accelerator": "gpu"},
        automation_condition=None,
    )
