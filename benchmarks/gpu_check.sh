#!/usr/bin/env bash
# GPU checks of the platform, one named section each, everything on stdout.
#
#   bash benchmarks/gpu_check.sh          # every section, in order
#   bash benchmarks/gpu_check.sh gat      # only the named sections
#
# To add a check: write a function `section_<name>` below (it runs from the
# repository root and returns non-zero on failure), keep it under its own time
# limit, and append <name> to SECTIONS. Without a CUDA device the script says
# so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

# GAT pretraining on a synthetic 7M-node / 50M-edge graph: edges/s, peak GPU memory, CPU/GPU ratio (< 8 min).
section_gat() {
  timeout 470 "$PYTHON" benchmarks/gpu_check_gat.py
}

# GRPO steps of the Graph-R1 policy (Qwen2.5-Coder-0.5B-Instruct if installed, else SmolLM2) in the real
# environment over a synthetic retriever: rollout tokens/s, update step time, peak GPU memory (< 8 min).
section_grpo() {
  timeout 470 "$PYTHON" benchmarks/gpu_check_grpo.py
}

SECTIONS=(gat grpo)

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch ($PYTHON); nothing to check"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

failed=()
for name in "${@:-${SECTIONS[@]}}"; do
  if ! declare -F "section_$name" >/dev/null; then
    echo "=== unknown section: $name (known: ${SECTIONS[*]}) ==="
    failed+=("$name")
    continue
  fi
  echo "=== $name ==="
  start=$SECONDS
  if "section_$name"; then
    echo "=== $name: ok in $((SECONDS - start))s ==="
  else
    echo "=== $name: FAILED (exit $?) after $((SECONDS - start))s ==="
    failed+=("$name")
  fi
done
[ ${#failed[@]} -eq 0 ] || { echo "failed sections: ${failed[*]}"; exit 1; }
