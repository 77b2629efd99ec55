#!/usr/bin/env bash
# GPU check: the CUDA-marked tests and `optimshift bench --json` (offload/reload/move, and the streamed step of
# issue 12 with its goals), on one GPU, in under 10 minutes.
# Writes benchmarks/results/gpu-<date>.{json,txt} (the bench) and gpu-<date>-tests.txt (pytest's summary).
# Run from the repo root on a machine with a CUDA GPU: `bash benchmarks/gpu_check.sh`.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  python3 -m venv .venv && PY="$ROOT/.venv/bin/python"
  "$PY" -m pip install -q -c constraints.txt torch==2.13.0 && "$PY" -m pip install -q -c constraints.txt -e '.[test]'
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 2
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
out="benchmarks/results"
mkdir -p "$out"
timeout 300 "$PY" -m pytest -q -m cuda tests 2>&1 | tail -n 40 | tee "$out/gpu-$stamp-tests.txt"
tests_rc=${PIPESTATUS[0]}
timeout 280 "$PY" -m optimshift.bench --out "$out/gpu-$stamp.json" | tee "$out/gpu-$stamp.txt"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
