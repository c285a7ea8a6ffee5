#!/usr/bin/env bash
# `make test`: the suite in three lanes at once, each its own pytest process,
# since most of a test's time is spent waiting on a server (a probe, a stall
# limit, a restart), not on the CPU:
#   engine-newest  what depends on mlx-lm's version, against the newest mlx-lm
#   engine-0313    the same, against the incident's mlx-lm 0.31.3
#   rest-newest    subprocess mode (the supervisor imports no mlx_lm) and the
#                  tests marked one_version, against the newest only
# Each lane's output goes to .test-logs/LANE.log and is printed whole when the
# lanes are done; the exit status is the first failing lane's.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION_TESTS="not subprocess_mode and not one_version"
declare -A LANES=(
    [engine-newest]=".venv/bin/python -m pytest -m '$VERSION_TESTS'"
    [engine-0313]=".venv-0313/bin/python -m pytest -m '$VERSION_TESTS'"
    [rest-newest]=".venv/bin/python -m pytest -m 'subprocess_mode or one_version'"
)
ORDER=(engine-newest engine-0313 rest-newest)
mkdir -p .test-logs
declare -A PIDS
started=$SECONDS
for lane in "${ORDER[@]}"; do
    bash -c "${LANES[$lane]} $*" > ".test-logs/$lane.log" 2>&1 &
    PIDS[$lane]=$!
    echo "lane $lane: ${LANES[$lane]} $* (log: .test-logs/$lane.log)"
done
status=0
declare -A RESULTS
for lane in "${ORDER[@]}"; do
    wait "${PIDS[$lane]}"
    code=$?
    RESULTS[$lane]="exit $code at $((SECONDS - started)) s"
    [ "$status" = 0 ] && status=$code
done
for lane in "${ORDER[@]}"; do
    echo; echo "================ lane $lane (${RESULTS[$lane]}) ================"
    cat ".test-logs/$lane.log"
done
echo; echo "lanes done in $((SECONDS - started)) s:"
for lane in "${ORDER[@]}"; do echo "  $lane: ${RESULTS[$lane]}; $(tail -n 1 ".test-logs/$lane.log")"; done
exit "$status"
