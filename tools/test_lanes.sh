#!/usr/bin/env bash
# `make test`: the suite in two lanes at once, one per mlx-lm, each a pytest whose
# test modules pytest-xdist spreads over workers (--dist loadfile: a module's
# tests, and the server they share, stay on one worker). Most of a test's time is
# spent waiting on a server (a probe, a stall limit, a restart), not on the CPU,
# so six workers keep this machine's two cores busier than fewer would:
#   newest  every test, against the newest mlx-lm, but the one_version modules
#           marked lane_0313 (-n NEWEST_WORKERS)
#   0313    what depends on mlx-lm's version, against the incident's mlx-lm
#           0.31.3, and the one_version modules marked lane_0313, which even out
#           the two lanes' time (-n OLDEST_WORKERS)
# The supervisor's tests (subprocess_mode: the supervisor imports no mlx_lm) run in
# the newest's lane. Each lane's output goes to .test-logs/LANE.log and is printed
# whole when the lanes are done; the exit status is the first failing lane's.
# Arguments are passed to every pytest. (Plain arrays: macOS's /bin/bash is 3.2.)
# Each worker takes ports of its own (tests/conftest.py: at most 4 workers a lane).
set -uo pipefail
cd "$(dirname "$0")/.."
NEWEST_WORKERS=${NEWEST_WORKERS:-4}
OLDEST_WORKERS=${OLDEST_WORKERS:-2}
MOVED="lane_0313 and not subprocess_mode"
NAMES=(newest 0313)
PYTHONS=(.venv/bin/python .venv-0313/bin/python)
WORKERS=("$NEWEST_WORKERS" "$OLDEST_WORKERS")
MARKS=("not ($MOVED)" "(not subprocess_mode and not one_version) or ($MOVED)")
mkdir -p .test-logs
started=$SECONDS
PIDS=()
for i in 0 1; do
    GUARDIAN_TEST_LANE=$i "${PYTHONS[$i]}" -m pytest -n "${WORKERS[$i]}" --dist loadfile -m "${MARKS[$i]}" "$@" \
        > ".test-logs/${NAMES[$i]}.log" 2>&1 &
    PIDS[$i]=$!
    echo "lane ${NAMES[$i]}: ${PYTHONS[$i]} -m pytest -n ${WORKERS[$i]} --dist loadfile -m '${MARKS[$i]}' $*" \
         "(log: .test-logs/${NAMES[$i]}.log)"
done
status=0
RESULTS=()
for i in 0 1; do
    wait "${PIDS[$i]}"
    code=$?
    RESULTS[$i]="exit $code at $((SECONDS - started)) s"
    [ "$status" = 0 ] && status=$code
done
for i in 0 1; do
    echo; echo "================ lane ${NAMES[$i]} (${RESULTS[$i]}) ================"
    cat ".test-logs/${NAMES[$i]}.log"
done
echo; echo "lanes done in $((SECONDS - started)) s:"
for i in 0 1; do
    echo "  ${NAMES[$i]}: ${RESULTS[$i]}; $(tail -n 1 ".test-logs/${NAMES[$i]}.log")"
done
exit "$status"
