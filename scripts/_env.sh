# Shared set-up: create or reuse .venv at the repo root and install optimshift with what it needs.
# Sourced by scripts/demo and scripts/test. The torch wheel is pinned (constraints.txt).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OPTIMSHIFT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/constraints.txt")
STAMP="$VENV/.optimshift-installed-$1"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/constraints.txt" -nt "$STAMP" ]; then
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e "$ROOT[$1]"
  touch "$STAMP"
fi
