#!/usr/bin/env bash
# Runs ON the lent GPU machine (through the device tool), from the repository
# root, with the wheels tools/gpu/fetch_wheels.sh prepared here.
#
#   tools/gpu/device_setup.sh stash                 call 1: carry .whl/part1; keep it in /tmp
#   tools/gpu/device_setup.sh test PYTEST_ARGS...   call 2: carry .whl/part2; join, install, pytest
#   tools/gpu/device_setup.sh run COMMAND...        call 2 (or later): join, install, run COMMAND
#   EXTRA_WHEELS=.whl/mlx-lm-0.31.3 ... test ...    the same with these wheels over the others
#
# Call 2 must come while the machine from call 1 is still warm (it is given
# back 30 s after a call): a fresh machine has no piece 1, and this says so.
# Everything is installed into /tmp/site (PYTHONPATH), never into the image's
# python3. Logs and results go to $OUT, which comes back to the caller.
set -uo pipefail

STASH=/tmp/guardian-wheels
SITE=/tmp/site
OUT=${OUT:-/tmp/guardian-out}
mkdir -p "$OUT"

machine() {
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
    python3 --version
}

stash() {
    mkdir -p "$STASH"
    cp .whl/part1/* "$STASH"/ || { echo "no .whl/part1: carry it (carry: [\".whl/part1\"])" >&2; exit 2; }
    machine
    ls -l "$STASH"
    echo "piece 1 kept in $STASH; now call 2 within 30 s, carrying .whl/part2"
}

install() {
    if [ -f "$SITE/.installed" ] && cmp -s "$SITE/.installed" .whl/part2/SHA256SUMS; then
        return 0  # a later call on the same warm machine
    fi
    [ -f .whl/part2/SHA256SUMS ] || { echo "no .whl/part2: carry it (carry: [\".whl/part2\"])" >&2; exit 2; }
    local name piece0 wheels=/tmp/guardian-joined
    name=$(cut -d' ' -f3 .whl/part2/SHA256SUMS)
    piece0=$(ls .whl/part1/"$name".part0 "$STASH/$name.part0" 2>/dev/null | head -1)
    if [ -z "$piece0" ]; then
        echo "piece 1 of $name is not on this machine: it is fresh (the last one was given" >&2
        echo "back). Run 'tools/gpu/device_setup.sh stash' carrying .whl/part1 first." >&2
        exit 3
    fi
    rm -rf "$wheels" && mkdir -p "$wheels"
    cat "$piece0" ".whl/part2/$name.part1" > "$wheels/$name"
    (cd "$wheels" && sha256sum -c --quiet "$OLDPWD/.whl/part2/SHA256SUMS") \
        || { echo "the joined $name does not match its checksum" >&2; exit 4; }
    cp .whl/part2/*.whl "$wheels"/
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$wheels"/*.whl || exit 5
    cp .whl/part2/SHA256SUMS "$SITE/.installed"
    # The code under test is always the tree's: only the wheel's metadata stays.
    rm -rf "$SITE/guardian"
    # Console scripts (mlx.launch: tests/test_distributed.py) where tests look
    # for them: beside the interpreter.
    local bin
    bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
    for script in "$SITE"/bin/*; do
        [ -e "$bin/$(basename "$script")" ] || ln -s "$script" "$bin/"
    done
}

metadata() {
    # The guardian's own metadata from this tree's pyproject.toml (its plugins
    # are entry points, and the tree may have more than when the wheels were
    # fetched); the carried wheel's is the fallback.
    rm -rf /tmp/guardian-meta
    if python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
            --target /tmp/guardian-meta . 2>/tmp/guardian-meta.log; then
        rm -rf "$SITE"/mlx_guardian-*.dist-info
        cp -r /tmp/guardian-meta/mlx_guardian-*.dist-info "$SITE"/
    else
        echo "the guardian's metadata could not be built here (see /tmp/guardian-meta.log):" \
             "using the carried wheel's, from when the wheels were fetched" >&2
    fi
    # The plugins under plugins/ whole (their code is small; their tests load them
    # through their entry points, as `make test`'s editable installs do).
    rm -rf /tmp/guardian-plugins
    if python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
            --target /tmp/guardian-plugins plugins/notifier plugins/example 2>/tmp/guardian-plugins.log; then
        cp -r /tmp/guardian-plugins/. "$SITE"/
    else
        echo "the plugins under plugins/ could not be installed here (see /tmp/guardian-plugins.log)" >&2
    fi
}

environment() {
    # The tree's guardian/ for a process started in another folder too (a test's
    # server with its own working folder, a bench script): the installed wheel's is removed.
    export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
    # A CUDA context does not survive a fork: servers forked from the tests' fork
    # server (tests/forkserver.py) failed their model load with "cudaStreamSynchronize
    # (free_streams_[i]) failed: initialization error". Every server starts whole here.
    export GUARDIAN_TEST_FORKSERVER=0
    # Another mlx-lm (or any wheel) over the installed ones: EXTRA_WHEELS names a
    # carried folder, e.g. EXTRA_WHEELS=.whl/mlx-lm-0.31.3 for the incident's version.
    if [ -n "${EXTRA_WHEELS:-}" ]; then
        rm -rf /tmp/site-extra
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/site-extra "$EXTRA_WHEELS"/*.whl || exit 5
        export PYTHONPATH=/tmp/site-extra:$SITE:$PWD
    fi
    metadata
    # The guardian's hub-free demo model and stock's cached test file live in the tree.
    machine
    python3 -c 'import mlx.core as mx, mlx_lm, importlib.metadata as m
print("mlx", mx.__version__, "mlx-lm", m.version("mlx-lm"), "device", mx.default_device(),
      "cuda", mx.cuda.is_available())' || exit 6
}

case "${1:-}" in
    stash)
        stash
        ;;
    test)
        shift
        install
        environment
        started=$(date +%s)
        touch /tmp/guardian-test-start
        # mlx compiles CUDA kernels at first use and keeps them on disk: fill
        # that cache first, or a dozen fresh servers compile at once and tests
        # with 1 s stall limits see compiles as stalls (WARM=0 skips it).
        if [ "${WARM:-1}" != 0 ]; then
            python3 tools/gpu/warm_kernels.py --out "$OUT/warm_kernels.json" 2>&1 | tee "$OUT/warm_kernels.log"
        fi
        # SIGINT at the deadline: pytest stops and still prints its summary,
        # inside the device tool's 10 minutes a call.
        timeout -s INT "${PYTEST_DEADLINE_S:-510}" \
            python3 -m pytest -p no:cacheprovider --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log"
        status=${PIPESTATUS[0]}
        echo "pytest exit $status in $(( $(date +%s) - started )) s"
        # The servers' own logs (JSON lines) of this run, for the failures.
        find /tmp/pytest-of-* -name '*.log' -newer /tmp/guardian-test-start -print0 2>/dev/null \
            | tar -czf "$OUT/server-logs.tar.gz" --null -T - 2>/dev/null || true
        exit "$status"
        ;;
    run)
        shift
        install
        environment
        "$@" 2>&1 | tee "$OUT/run.log"
        exit "${PIPESTATUS[0]}"
        ;;
    *)
        sed -n '2,12p' "$0"
        exit 2
        ;;
esac
