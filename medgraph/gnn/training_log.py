"""What a GAT training run records: its MLflow run (metrics, graph sizes, history, training curve, the model),
the baseline its champion gate compares with, and the numbers the model asset shows."""

from __future__ import annotations

import mlflow

from medgraph.gnn.train import GatResult
from medgraph.tracking import Baseline, Tracking


def untrained_baseline(result: GatResult) -> Baseline:
    """The GAT gate's baseline: the same architecture and seed untrained, on the same validation edges."""
    return Baseline("untrained GAT (same architecture and seed)",
                    {"valid_roc_auc": result.metrics["valid_roc_auc_untrained"]})


def log_gat_result(tracking: Tracking, result: GatResult) -> str:
    """Log a trained GAT in the active run (metrics and timings, graph sizes, per-epoch history, relation
    labels, the training curve, the model); returns the logged model's URI."""
    mlflow.log_metrics({**result.metrics, **{f"time_{k}": v for k, v in result.timings.items()}})
    mlflow.log_params({f"graph_{k}": v for k, v in result.graph.items()})
    mlflow.log_dict({"history": result.history, "relations": list(result.relations)}, "training.json")
    mlflow.log_figure(training_curve_figure(result), "training_curve.png")
    return tracking.log_torch_model(result.model, metadata={
        "relations": len(result.relations), "feature_table": result.model.feature_table,
        "feature_encoder_id": result.model.feature_encoder_id})


def result_metadata(result: GatResult) -> dict[str, float]:
    """The validation and test metrics, and the training throughput, as the model asset shows them."""
    return {**{k: float(v) for k, v in result.metrics.items()},
            "edges_per_second": result.timings["edges_per_second"],
            "train_seconds": result.timings["train_seconds"]}


def history_markdown(result: GatResult) -> str:
    """One table row per epoch: step, train loss, validation ROC-AUC, seconds."""
    lines = ["| epoch | step | train loss | valid ROC-AUC | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {int(r['epoch'])} | {int(r['step'])} | {r['train_loss']:.4f} | {r['valid_roc_auc']:.4f} "
              f"| {r['seconds']:.1f} |" for r in result.history]
    return "\n".join(lines)


def training_curve_figure(result: GatResult):  # -> matplotlib Figure
    """Train loss and validation ROC-AUC per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [int(r["epoch"]) for r in result.history]
    fig, loss_axis = plt.subplots(figsize=(6, 3.5))
    loss_axis.plot(epochs, [r["train_loss"] for r in result.history], "o-", color="tab:blue", label="train loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("train loss", color="tab:blue")
    auc_axis = loss_axis.twinx()
    auc_axis.plot(epochs, [r["valid_roc_auc"] for r in result.history], "s-", color="tab:orange")
    auc_axis.set_ylabel("validation ROC-AUC", color="tab:orange")
    fig.suptitle("GAT triple classification")
    fig.tight_layout()
    return fig
