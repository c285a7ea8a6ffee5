#!/bin/sh
# The system tools some tests run as real components: HAProxy
# (tests/test_haproxy.py), Open MPI (tests/test_mpi_kept_out.py) and Prometheus
# with promtool (tests/test_prometheus_alerts.py, tests/test_metrics.py).
# Installed with Homebrew where it is present (macOS), else with apt-get where
# this user may run it (Debian, Ubuntu). Otherwise, or if the install fails,
# their tests skip and say what is missing: an optional tool never fails
# `make test`, so this script always exits 0.
missing=""
have() { command -v "$1" >/dev/null 2>&1; }
have haproxy || missing="$missing haproxy"
# Open MPI's tests are Linux's (tests/test_mpi_kept_out.py): Homebrew's would pull in gcc for nothing.
[ "$(uname)" = Darwin ] || have mpirun || missing="$missing mpirun"
{ have prometheus && have promtool; } || missing="$missing prometheus"
[ -z "$missing" ] && exit 0

if have brew; then
    packages=$(echo "$missing" | sed 's/mpirun/open-mpi/')
    echo "system-packages: brew install$packages"
    brew install $packages || echo "system-packages: brew could not install$packages; their tests will skip"
elif have apt-get && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
    $sudo apt-get update -qq || echo "system-packages: apt-get update failed"
    packages=$(echo "$missing" | sed 's/mpirun/openmpi-bin/; s/ prometheus//')
    if [ -n "$packages" ]; then
        echo "system-packages: apt-get install$packages"
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $packages ||
            echo "system-packages: apt-get could not install$packages; their tests will skip"
    fi
    case "$missing" in *prometheus*)
        # Debian's package would install a service that starts a Prometheus on :9090 and keeps
        # it running: only its two programs are taken (static binaries, no dependencies).
        echo "system-packages: prometheus and promtool from Debian's prometheus package, to /usr/local/bin"
        unpacked=$(mktemp -d)
        { (cd "$unpacked" && apt-get download -qq prometheus 2>/dev/null) &&
          dpkg-deb -x "$unpacked"/prometheus_*.deb "$unpacked/root" &&
          $sudo install -m 755 "$unpacked/root/usr/bin/prometheus" "$unpacked/root/usr/bin/promtool" /usr/local/bin/; } ||
            echo "system-packages: could not get prometheus; its tests will skip"
        rm -rf "$unpacked"
    esac
else
    echo "system-packages: not installed:$missing (no Homebrew, no apt-get we may run); their tests will skip"
fi
exit 0
