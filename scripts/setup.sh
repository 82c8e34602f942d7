#!/usr/bin/env bash
# Idempotent machine set-up for xagg: apt packages, the kernel-headers link bcc
# needs, and a venv (torch CPU, numpy, click, pyroute2, prometheus-client, scipy)
# that can import bcc.
# Safe to run repeatedly; each step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

say() { printf '[setup] %s\n' "$*"; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root for: $*"; return 1; fi; }

# 1. apt packages (bcc from Debian: it is not on PyPI; systemd for the
# `systemd-analyze verify` of daemon/xaggd.service in tests/test_service_unit.py).
APT_PKGS="clang python3-bpfcc linux-headers-amd64 nftables iproute2 ethtool procps iputils-ping libxdp-dev libbpf-dev systemd openssl util-linux"
missing=""
for p in $APT_PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    say "installing apt packages:$missing"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

# 2. kernel headers: bcc looks in /lib/modules/$(uname -r)/{build,source}. Kernels
# that ship none (cloud/firecracker builds) get the Debian headers linked there.
KDIR=/lib/modules/$(uname -r)
if [ ! -e "$KDIR/build/include" ]; then
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1 || true)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1 || true)
    if [ -n "$hdr" ] && [ -n "$common" ]; then
        say "linking $KDIR/{build,source} -> $hdr, $common"
        as_root mkdir -p "$KDIR"
        as_root ln -sfn "$hdr" "$KDIR/build"
        as_root ln -sfn "$common" "$KDIR/source"
    else
        say "WARNING: no kernel headers found under /usr/src; XDP programs will not compile"
    fi
fi

# 3. the venv.
if [ ! -x "$VENV/bin/python" ]; then
    say "creating venv $VENV"
    "$PY" -m venv "$VENV"
fi
# the probe says what is missing in one line (a first run misses everything)
if ! "$VENV/bin/python" scripts/venv_ready.py; then
    say "installing python packages into $VENV (torch CPU build)"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "torch==2.13.0"
    "$VENV/bin/pip" install -q numpy click pyroute2 scipy "prometheus-client>=0.20" "setuptools>=77" \
        pytest pytest-timeout scikit-learn matplotlib
fi
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || "$VENV/bin/pip" install -q --no-deps -e .

# 4. bcc into the venv: link just the bcc package (pure Python over libbcc.so.0),
# not all of Debian's dist-packages.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/bcc ] && [ ! -e "$SITE/bcc" ]; then
    ln -sfn /usr/lib/python3/dist-packages/bcc "$SITE/bcc"
fi
"$VENV/bin/python" -c 'import bcc' 2>/dev/null && say "ok: venv ready, bcc importable" \
    || say "WARNING: bcc not importable (XDP path unavailable; the userspace aggregator still works)"

# 5. the client's compiled round loop and codec (xagg/client/csrc/exchange.c, codec.c):
# built now so the first all-reduce does not wait for the compiler; without it the
# client runs numpy.
"$VENV/bin/python" -m xagg.client.native >/dev/null 2>&1 && say "ok: compiled client round loop" \
    || say "WARNING: client round loop did not compile (the client falls back to numpy): run $VENV/bin/python -m xagg.client.native"
