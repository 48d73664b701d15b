#!/usr/bin/env bash
# Run every benchmark in benchmarks/ (called by `make bench`). Each script prints its own figures,
# with a ratio against a baseline measured in the same run. A failing script is reported and the
# others still run; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
failed=()
for script in benchmarks/bench_*.py; do
    echo "=== $script"
    if ! "$PYTHON" "$script"; then
        echo "=== $script FAILED" >&2
        failed+=("$script")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
