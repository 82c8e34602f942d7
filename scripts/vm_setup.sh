#!/usr/bin/env bash
# Host packages for the VM targets (make vm-box, make vm-test): Vagrant with its
# libvirt plugin, libvirt, QEMU/KVM, debootstrap and the image tools. Idempotent:
# installs only what is missing. Needs root (apt-get) and /dev/kvm.
set -euo pipefail
say() { printf '[vm-setup] %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

PKGS="vagrant vagrant-libvirt libvirt-daemon-system libvirt-clients qemu-system-x86 qemu-utils
      debootstrap e2fsprogs dnsmasq-base rsync openssh-client iptables"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    say "installing:$missing"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $missing >/dev/null
fi
[ -c /dev/kvm ] || { say "ERROR: /dev/kvm is missing: the VMs need KVM"; exit 1; }
# libvirt runs qemu as libvirt-qemu (group kvm). udev's rule gives /dev/kvm to
# that group; with no udev running here the node is root's alone, so do the same.
if [ "$(stat -c %G:%a /dev/kvm)" != kvm:660 ] && getent group kvm >/dev/null; then
    as_root chgrp kvm /dev/kvm && as_root chmod 660 /dev/kvm
    say "/dev/kvm: group kvm, mode 660 (as Debian's udev rule sets it)"
fi
say "ok: vagrant $(vagrant --version 2>/dev/null | awk '{print $2}'), $(qemu-system-x86_64 --version | head -n1)"
