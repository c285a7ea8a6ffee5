#!/bin/sh
# The system tools some tests run as real components: HAProxy
# (tests/test_haproxy.py) and Open MPI (tests/test_mpi_kept_out.py).
# Installed with Homebrew where it is present (macOS), else with apt-get where
# this user may run it (Debian, Ubuntu). Otherwise, or if the install fails,
# their tests skip and say what is missing: an optional tool never fails
# `make test`, so this script always exits 0.
missing=""
have() { command -v "$1" >/dev/null 2>&1; }
have haproxy || missing="$missing haproxy"
# Open MPI's tests are Linux's (tests/test_mpi_kept_out.py): Homebrew's would pull in gcc for nothing.
[ "$(uname)" = Darwin ] || have mpirun || missing="$missing mpirun"
[ -z "$missing" ] && exit 0

if have brew; then
    packages=$(echo "$missing" | sed 's/mpirun/open-mpi/')
    echo "system-packages: brew install$packages"
    brew install $packages || echo "system-packages: brew could not install$packages; their tests will skip"
elif have apt-get && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
    packages=$(echo "$missing" | sed 's/mpirun/openmpi-bin/')
    echo "system-packages: apt-get install$packages"
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $packages; } ||
        echo "system-packages: apt-get could not install$packages; their tests will skip"
else
    echo "system-packages: not installed:$missing (no Homebrew, no apt-get we may run); their tests will skip"
fi
exit 0
