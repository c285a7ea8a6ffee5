#!/usr/bin/env bash
# `make test`: the suite in three lanes at once, each its own pytest process,
# since most of a test's time is spent waiting on a server (a probe, a stall
# limit, a restart), not on the CPU:
#   engine-newest  what depends on mlx-lm's version, against the newest mlx-lm, and
#                  the one_version tests marked lane_newest
#   engine-0313    the same, against the incident's mlx-lm 0.31.3, and the
#                  one_version tests marked lane_0313
#   rest-newest    subprocess mode (the supervisor imports no mlx_lm) and the
#                  other tests marked one_version, against the newest only
# Each lane's output goes to .test-logs/LANE.log and is printed whole when the
# lanes are done; the exit status is the first failing lane's. Arguments are
# passed to every pytest. (Plain arrays: macOS's /bin/bash is 3.2.)
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION_TESTS="not subprocess_mode and not one_version"
# Some one_version modules run in the 0.31.3 lane instead (marked lane_0313): the rest
# lane, with every supervisor test, ended ~90 s after the other two.
MOVED="lane_0313 and not subprocess_mode"
# And some to the newest's engine lane (marked lane_newest): the rest lane still ended last.
MOVED_NEWEST="lane_newest and not subprocess_mode"
NAMES=(engine-newest engine-0313 rest-newest)
PYTHONS=(.venv/bin/python .venv-0313/bin/python .venv/bin/python)
MARKS=("($VERSION_TESTS) or ($MOVED_NEWEST)" "($VERSION_TESTS) or ($MOVED)"
       "(subprocess_mode or one_version) and not ($MOVED) and not ($MOVED_NEWEST)")
mkdir -p .test-logs
started=$SECONDS
PIDS=()
for i in 0 1 2; do
    GUARDIAN_TEST_LANE=$i "${PYTHONS[$i]}" -m pytest -m "${MARKS[$i]}" "$@" > ".test-logs/${NAMES[$i]}.log" 2>&1 &
    PIDS[$i]=$!
    echo "lane ${NAMES[$i]}: ${PYTHONS[$i]} -m pytest -m '${MARKS[$i]}' $* (log: .test-logs/${NAMES[$i]}.log)"
done
status=0
RESULTS=()
for i in 0 1 2; do
    wait "${PIDS[$i]}"
    code=$?
    RESULTS[$i]="exit $code at $((SECONDS - started)) s"
    [ "$status" = 0 ] && status=$code
done
for i in 0 1 2; do
    echo; echo "================ lane ${NAMES[$i]} (${RESULTS[$i]}) ================"
    cat ".test-logs/${NAMES[$i]}.log"
done
echo; echo "lanes done in $((SECONDS - started)) s:"
for i in 0 1 2; do
    echo "  ${NAMES[$i]}: ${RESULTS[$i]}; $(tail -n 1 ".test-logs/${NAMES[$i]}.log")"
done
exit "$status"
