"""GAT pretraining at UMLS scale on one CUDA GPU: edges/s, peak GPU memory, CPU/GPU speed ratio.

A synthetic UMLS-shaped graph (default 7M nodes, 50M edges, 16 relations, every
relation in both directions) with 384-d random unit features generated on the
GPU. Steps, each timed and printed:

1. build the graph and prepare the splits (numpy / torch on the CPU);
2. train with the `full` profile (bf16 autocast, batch 4096, fanouts (15, 10))
   for --steps steps on the GPU: steady-state edges/s from the steps after
   --warmup, and torch.cuda.max_memory_allocated;
3. the same configuration for --cpu-steps steps on the CPU (features copied to
   host memory): seconds per step and the CPU/GPU ratio.

Everything goes to stdout; the whole check is sized to finish in under 8
minutes on an H200. Without a CUDA device it says so and exits 0.
`--device cpu --nodes 20000 --edges 140000` runs the same code path on the CPU
(a smoke test of the script, not a measurement).

    python benchmarks/gpu_check_gat.py [--nodes 7000000 --edges 50000000 --steps 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gat_train import synthetic_graph_index

from medgraph.gnn.train import GatConfig, fit_gat, prepare_graph

GIB = 2**30


def timed_fit(data, features: torch.Tensor, config: GatConfig, warmup: int) -> tuple[float, dict[str, float]]:
    """Train `config` and return (seconds per step after `warmup` steps, metrics)."""
    marks: dict[int, float] = {}

    def mark(step: int, metrics: dict[str, float]) -> None:
        if step not in marks:  # the training-loss call of a step comes before any epoch-end call
            marks[step] = time.perf_counter()

    result = fit_gat(data, features, config, log_fn=mark)
    steps = sorted(s for s in marks if 0 < s <= config.steps_per_epoch)
    first = max(s for s in steps if s <= warmup) if warmup else steps[0]
    last = steps[-1]
    per_step = (marks[last] - marks[first]) / max(last - first, 1)
    return per_step, {**result.metrics, **result.timings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=7_000_000)
    parser.add_argument("--edges", type=int, default=50_000_000)
    parser.add_argument("--steps", type=int, default=60, help="GPU training steps")
    parser.add_argument("--warmup", type=int, default=10, help="GPU steps left out of the rate")
    parser.add_argument("--cpu-steps", type=int, default=3, help="CPU steps (the first is left out of the rate)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to smoke-test this script")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; the CPU run is skipped past 75%%")
    args = parser.parse_args()
    started = time.perf_counter()

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check_gat: no CUDA device visible to torch; skipping the GAT GPU check")
        return 0
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}"
          + (f": {torch.cuda.get_device_name(device)}, {torch.cuda.get_device_properties(device).total_memory / GIB:.0f} GiB"
             if device.type == "cuda" else "") + f", {torch.get_num_threads()} CPU threads", flush=True)

    t = time.perf_counter()
    index = synthetic_graph_index(args.edges, args.nodes)
    config = GatConfig.profile("full", device=str(device), epochs=1, steps_per_epoch=args.steps,
                               log_every=1, checkpoint_every=0, eval_edges=1024, progress=False)
    data = prepare_graph(index, config)
    del index
    print(f"graph: {data.num_nodes:,} nodes, {data.known.keys.numel():,} edges "
          f"({data.message_passing.num_edges:,} message-passing); built and split in {time.perf_counter() - t:.1f}s",
          flush=True)

    t = time.perf_counter()
    features = torch.randn(data.num_nodes, 384, device=device, generator=torch.Generator(device).manual_seed(0))
    features /= features.norm(dim=1, keepdim=True)
    print(f"features: {tuple(features.shape)} float32 on {device} "
          f"({features.numel() * 4 / GIB:.1f} GiB) in {time.perf_counter() - t:.1f}s", flush=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    print(f"\n[{device}] {args.steps} steps: batch {config.batch_size}, fanouts {config.fanouts}, hidden "
          f"{config.hidden}, heads {config.heads}, amp {config.amp}", flush=True)
    gpu_step, gpu = timed_fit(data, features, config, args.warmup)
    gpu_rate = config.batch_size / gpu_step
    print(f"[{device}] {gpu_step:.3f} s/step, {gpu_rate:,.0f} edges/s (steady state, after {args.warmup} steps); "
          f"whole run incl. warmup {gpu['edges_per_second']:,.0f} edges/s, eval {gpu['eval_seconds']:.1f}s")
    if device.type == "cuda":
        print(f"[{device}] peak GPU memory (max_memory_allocated): "
              f"{torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB, of which features "
              f"{features.numel() * 4 / GIB:.1f} GiB", flush=True)
    print(f"[{device}] after {args.steps} steps: valid ROC-AUC {gpu['valid_roc_auc']:.3f}, "
          f"test ROC-AUC {gpu['test_roc_auc']:.3f} (random features: structure only)", flush=True)

    cpu_step = None
    if args.cpu_steps and time.perf_counter() - started < 0.75 * args.budget:
        features = features.cpu()
        cpu_config = GatConfig.profile("full", device="cpu", epochs=1, steps_per_epoch=args.cpu_steps, log_every=1,
                                       checkpoint_every=0, eval_edges=32, rank_negatives=5, progress=False)
        print(f"\n[cpu] {args.cpu_steps} steps of the same configuration", flush=True)
        cpu_step, _ = timed_fit(data, features, cpu_config, warmup=1)
        print(f"[cpu] {cpu_step:.2f} s/step, {cpu_config.batch_size / cpu_step:,.0f} edges/s", flush=True)
    elif args.cpu_steps:
        print("\n[cpu] skipped: past 75% of the time budget")

    print("\nsummary")
    rows = [(f"{device.type} edges/s", f"{gpu_rate:,.0f}")]
    if device.type == "cuda":
        rows.append(("peak GPU memory", f"{torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB"))
    if cpu_step:
        rows.append(("cpu edges/s", f"{config.batch_size / cpu_step:,.0f}"))
        rows.append((f"cpu / {device.type} time per step", f"{cpu_step / gpu_step:.1f}x"))
    rows.append(("wall time", f"{time.perf_counter() - started:.0f}s"))
    for label, value in rows:
        print(f"  {label:<26}{value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
