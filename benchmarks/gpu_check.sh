#!/usr/bin/env bash
# GPU check: the CUDA-marked tests, the keep_addresses check, then the benchmark cases, on one GPU, in under 8
# minutes, with no network.
#
#   bash benchmarks/gpu_check.sh [DIR]        # from anywhere; PYTHON=/path/to/python to choose the interpreter
#
# Nothing is installed or fetched: the GPU machines this runs on are lent for minutes and reach no network. It
# runs on an interpreter that already has a CUDA torch in the range pyproject.toml's `dependencies` give
# (PYTHON, else python3), with pytest for the tests; optimshift itself is imported from this tree's src/
# (PYTHONPATH), so it need not be installed (or is installed with --no-deps).
# Writes benchmarks/results/gpu-<stamp>-tests.txt, gpu-<stamp>-keep-addresses.txt (benchmarks/gpu_keep_addresses.py:
# CUDA virtual memory mapped, unmapped and mapped again under a captured graph; a reduce-overhead compiled capturable
# Adam through 10 keep_addresses cycles, no cudagraph recording after the first, and a control that records every
# cycle), gpu-<stamp>-<case>.{json,txt} and gpu-<stamp>-summary.txt,
# and copies them into DIR when one is given.
# Exit status: 0 everything passed; 1 a test or a bench case failed or ran out of its time; 2 no CUDA device;
# 3 no usable interpreter, a torch outside the supported range, or budgets that do not fit.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
COPY_TO="${1:-}"

TESTS_BUDGET=160  # seconds for `pytest -m cuda`
KEEP_BUDGET=100  # seconds for benchmarks/gpu_keep_addresses.py (two reduce-overhead compilations)
# The bench cases, one a line: name, budget in seconds, arguments to `python -m optimshift.bench`.
# The quick run first, so that a full run cut short still leaves figures.
BENCH_CASES=(
  "quick 50 --quick"
  "full 85"
  "verl 25 --case verl"
  "rl-loop 25 --case rl-loop"
  "deepspeed 25 --case deepspeed"  # one line and status 0 where deepspeed is not installed
)
TOTAL_BUDGET=470  # tests + every case, in seconds: the whole check ends within 8 minutes

say() { echo "gpu_check: $*"; }

total=$((TESTS_BUDGET + KEEP_BUDGET))
for case in "${BENCH_CASES[@]}"; do
  read -r _ secs _ <<<"$case"
  total=$((total + secs))
done
if [ "$total" -gt "$TOTAL_BUDGET" ]; then
  say "the budgets add up to ${total}s, over ${TOTAL_BUDGET}s (8 minutes with the set-up): shorten a case"
  exit 3
fi

if ! command -v "$PY" >/dev/null 2>&1; then
  say "no Python interpreter '$PY' (set PYTHON to one that has a CUDA torch)"
  exit 3
fi

# One line about the interpreter's torch, and the status: 0 a CUDA device, 2 none, 3 no torch or one outside
# pyproject's range. Only torch is imported here: an unsupported torch must be refused before optimshift loads.
info="$("$PY" - "$ROOT/pyproject.toml" <<'PYCHECK' 2>&1
import re
import sys

def refuse(code, message):
    print(message)
    sys.exit(code)

text = open(sys.argv[1], encoding="utf-8").read()
deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)
spec = re.search(r"[\"']torch\s*([^\"';]*)[\"']", deps.group(1)) if deps else None
if spec is None:
    refuse(3, f"no torch requirement in the dependencies of {sys.argv[1]}")
spec = spec.group(1).replace(" ", "")


def release(version):
    """(2, 11, 0) for '2.11.0+cu130', '2.11.0a0' or '2.11'."""
    parts = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in parts.group(0).split(".")) if parts else ()


def pad(a, b):
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


OPS = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b,
       "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
try:
    import torch
except Exception as e:  # noqa: BLE001 - any failure to import is "no usable torch"
    refuse(3, f"{sys.executable} has no usable torch ({type(e).__name__}: {e}); torch{spec} is needed")
have = release(str(torch.__version__))
for clause in filter(None, spec.split(",")):
    op = re.match(r"(>=|<=|==|!=|>|<)", clause)
    if op is None or not OPS[op.group(1)](*pad(have, release(clause[len(op.group(1)):]))):
        refuse(3, f"torch {torch.__version__} at {sys.executable} is outside the range optimshift supports, "
                  f"torch{spec} (pyproject.toml dependencies): use an interpreter with a torch in that range")
if not torch.cuda.is_available():
    refuse(2, f"no CUDA device: nothing to check (torch {torch.__version__} at {sys.executable})")
name = torch.cuda.get_device_name(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {name}, python {sys.version.split()[0]} "
      f"at {sys.executable}")
PYCHECK
)"
status=$?
if [ "$status" -ne 0 ]; then
  [ "$status" -eq 2 ] || [ "$status" -eq 3 ] || status=3
  say "$(printf '%s\n' "$info" | tail -n 1)"
  exit "$status"
fi
say "$info"

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
out="$ROOT/benchmarks/results"
mkdir -p "$out"
summary="$out/gpu-$stamp-summary.txt"
{
  echo "gpu_check $stamp: $info"
  echo "optimshift from $("$PY" -c 'import optimshift; print(optimshift.__file__, optimshift.__version__)' 2>&1 | tail -n 1)"
} >"$summary"

# run NAME SECONDS LOG COMMAND...: COMMAND under `timeout`, its output in LOG (tail shown), a line in the summary
failed=0
run() {
  local name="$1" secs="$2" log="$3"
  shift 3
  local start=$SECONDS
  timeout -k 10 "$secs" "$@" >"$log" 2>&1
  local rc=$?
  tail -n 25 "$log"
  local line="$name: rc=$rc in $((SECONDS - start))s"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    line="$name: ran out of its ${secs}s (rc=$rc)"
  fi
  [ "$rc" -eq 0 ] || failed=1
  say "$line"
  echo "$line" >>"$summary"
}

run tests "$TESTS_BUDGET" "$out/gpu-$stamp-tests.txt" \
  "$PY" -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors tests
run keep-addresses "$KEEP_BUDGET" "$out/gpu-$stamp-keep-addresses.txt" \
  "$PY" "$ROOT/benchmarks/gpu_keep_addresses.py"
for case in "${BENCH_CASES[@]}"; do
  read -r name secs args <<<"$case"
  # shellcheck disable=SC2086  # args are words on purpose
  run "bench $name" "$secs" "$out/gpu-$stamp-$name.txt" \
    "$PY" -m optimshift.bench --out "$out/gpu-$stamp-$name.json" $args
done

if [ -n "$COPY_TO" ]; then
  mkdir -p "$COPY_TO" && cp "$out"/gpu-"$stamp"-* "$COPY_TO"/ && say "copied the results into $COPY_TO"
fi
say "results in benchmarks/results/gpu-$stamp-*"
exit "$failed"
