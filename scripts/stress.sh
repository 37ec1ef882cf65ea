#!/usr/bin/env bash
# `make test-stress`: the whole suite while two busy processes load the cores, as on a
# shared machine or a laptop doing other work. Deadlines in the tests stretch by one
# factor (FORGE_TEST_TIMEOUT_SCALE, default 3 here; see tests/helpers/timing.py); what
# they wait for is unchanged. FORGE_STRESS_RUNS=3 repeats the suite (stops at the first failure).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${FORGE_STRESS_RUNS:-1}
export FORGE_TEST_TIMEOUT_SCALE=${FORGE_TEST_TIMEOUT_SCALE:-3}
busy=()
stop_busy() {
    # Only the loops started here, by their pids.
    if [ ${#busy[@]} -gt 0 ]; then kill "${busy[@]}" 2>/dev/null || true; fi
}
trap stop_busy EXIT
for _ in 1 2; do
    python3 -c "while True: pass" &
    busy+=($!)
done
echo "forgerl: stress: busy loops ${busy[*]}; FORGE_TEST_TIMEOUT_SCALE=$FORGE_TEST_TIMEOUT_SCALE; $runs run(s)"
for i in $(seq "$runs"); do
    echo "forgerl: stress run $i of $runs"
    make --no-print-directory test  # the README's test command, one spelling of it
done
