#!/usr/bin/env bash
# Run the test suite: scripts/test.sh [pytest args...]   (docs/testing.md)
# Without a -m argument the main suite runs (-m "not slow"). Tests run in 2 worker processes, a file per worker
# (pytest-xdist, --dist loadfile), unless the arguments choose (-n N, -p no:xdist); SMARTINF_TEST_WORKERS sets the
# default. The 25 slowest tests are listed at the end. Exit code 5 (no tests collected) counts as success.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

bash scripts/setup.sh

VENV="${SMARTINF_VENV:-$REPO/.venv}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"

args=("$@")
has_marker=0
has_workers=0
has_durations=0
for a in "$@"; do
    case "$a" in
        -m | -m?*) has_marker=1 ;;
        -n | -n?* | --numprocesses* | no:xdist) has_workers=1 ;;
        --durations*) has_durations=1 ;;
    esac
done
if [[ "$has_marker" == "0" ]]; then
    args=(-m "not slow" "${args[@]}")
fi
if [[ "$has_workers" == "0" ]]; then
    args=(-n "${SMARTINF_TEST_WORKERS:-2}" --dist loadfile "${args[@]}")
fi
if [[ "$has_durations" == "0" ]]; then
    args=(--durations=25 "${args[@]}")
fi

rc=0
"$VENV/bin/python" -m pytest "${args[@]}" || rc=$?
if [[ "$rc" == "5" ]]; then
    echo "[test] pytest collected no tests (exit 5); treating as success"
    rc=0
fi
exit "$rc"
