#!/usr/bin/env bash
# `make vm-box`: a Debian bookworm Vagrant box for vagrant-libvirt, built from
# Debian packages alone (no box catalogue, no cloud image):
#   debootstrap -> root tree with sshd, the vagrant user (Vagrant's insecure key,
#   which vagrant swaps for a fresh one on first boot), ifupdown, the kernel,
#   every apt package scripts/setup.sh wants (the VMs have no way out to a
#   mirror), and the project's venv (/xagg/.venv) installed from the host's
#   wheels (scripts/vm_wheels.sh) -> ext4 filled straight from the tree (mke2fs -d, no loop mount)
#   -> qcow2 -> a .box added to vagrant as "xvm-bookworm".
# The VMs boot the box's kernel and initrd directly (libvirt <kernel>/<initrd>),
# so the disk needs no partition table or boot loader.
# Cached in two levels under XAGG_VM_CACHE (default /var/cache/xagg-vm): the
# image (minutes; keyed by build_image below and the package list) and the box
# (seconds; keyed by this whole script). A run with nothing changed only checks.
# XAGG_VM_REBUILD=1 rebuilds both.
set -euo pipefail
cd "$(dirname "$0")/.."
XVM_STEP_TAG=vm-box
. scripts/vm_common.sh

MIRROR=${XAGG_VM_MIRROR:-http://deb.debian.org/debian}
DISK_GB=${XAGG_VM_DISK_GB:-12}
# The project's own apt list (scripts/setup.sh), so provisioning finds it installed.
SETUP_PKGS=$(sed -n 's/^APT_PKGS="\(.*\)"/\1/p' scripts/setup.sh)
[ -n "$SETUP_PKGS" ] || die "could not read APT_PKGS from scripts/setup.sh"
BASE_PKGS="systemd-sysv udev dbus kmod openssh-server sudo ifupdown isc-dhcp-client
           linux-image-amd64 initramfs-tools ca-certificates python3 python3-venv make gcc libc6-dev
           rsync less"
# shellcheck disable=SC2086  # word lists
PKGS=$(echo $BASE_PKGS $SETUP_PKGS | tr ' ' '\n' | sort -u | paste -sd, -)
OUT=$XVM_CACHE/box
BOXFILE=$OUT/$XVM_BOX.box
WORK=$XVM_CACHE/build
ROOT=$WORK/root

# The root tree and its qcow2 image: the slow part, cached apart from the box
# packaging so that a change to the box's Vagrantfile does not redo it.
build_image() {
    [ -n "$ROOT" ] && [ "$ROOT" != / ] || die "refusing to build into '$ROOT'"
    rm -rf "$WORK" && mkdir -p "$WORK" "$XVM_CACHE/debs" "$OUT"
    say "debootstrap bookworm from $MIRROR (+$(echo "$PKGS" | tr ',' ' ' | wc -w) packages; debs cached in $XVM_CACHE/debs)"
    debootstrap --variant=minbase --cache-dir="$XVM_CACHE/debs" --include="$PKGS" \
        bookworm "$ROOT" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
        || { tail -n 30 "$WORK/debootstrap.log"; die "debootstrap failed (log: $WORK/debootstrap.log)"; }

    say "configuring the image"
    echo xvm > "$ROOT/etc/hostname"
    printf '127.0.0.1 localhost\n127.0.1.1 xvm\n' > "$ROOT/etc/hosts"
    echo "/dev/vda / ext4 defaults,noatime 0 1" > "$ROOT/etc/fstab"
    # eth0: the Vagrant management network (DHCP); vagrant appends the private network
    printf '%s\n' "source /etc/network/interfaces.d/*" "auto lo" "iface lo inet loopback" \
        "allow-hotplug eth0" "iface eth0 inet dhcp" > "$ROOT/etc/network/interfaces"
    # each VM its own machine id and ssh host keys (generated at boot)
    : > "$ROOT/etc/machine-id"
    rm -f "$ROOT"/etc/ssh/ssh_host_*
    mkdir -p "$ROOT/etc/systemd/system/ssh.service.d"
    printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
        > "$ROOT/etc/systemd/system/ssh.service.d/host-keys.conf"
    echo "UseDNS no" > "$ROOT/etc/ssh/sshd_config.d/vagrant.conf"
    # the vagrant user: passwordless sudo, Vagrant's well-known insecure key
    chroot "$ROOT" useradd -m -s /bin/bash vagrant
    echo "vagrant:vagrant" | chroot "$ROOT" chpasswd
    echo "vagrant ALL=(ALL) NOPASSWD:ALL" > "$ROOT/etc/sudoers.d/vagrant"
    chmod 0440 "$ROOT/etc/sudoers.d/vagrant"
    install -d -m 700 -o 1000 -g 1000 "$ROOT/home/vagrant/.ssh"
    install -m 600 -o 1000 -g 1000 "$(vagrant_insecure_pub)" "$ROOT/home/vagrant/.ssh/authorized_keys"
    # serial console for the boot log; no getty on tty1 (no screen), no apt timers (no mirror)
    chroot "$ROOT" systemctl enable serial-getty@ttyS0.service >/dev/null 2>&1 || true
    chroot "$ROOT" systemctl mask getty@tty1.service apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1 || true
    chroot "$ROOT" apt-get clean
    # The project's venv, installed here at the host's speed from the host's wheels
    # (the VMs may run under emulation, where unpacking torch takes many minutes):
    # `make setup` in the VM finds it complete and only adds the project itself.
    say "venv /xagg/.venv from the host's wheels ($(ls "$XVM_CACHE/wheels"/*.whl | wc -l) wheels)"
    mkdir -p "$ROOT/xagg" "$ROOT/tmp/wheels"
    cp "$XVM_CACHE/wheels"/*.whl "$ROOT/tmp/wheels/"
    chroot "$ROOT" python3 -m venv /xagg/.venv
    # shellcheck disable=SC2046  # one word per wheel requirement
    chroot "$ROOT" /xagg/.venv/bin/pip install -q --no-index --find-links /tmp/wheels \
        $(cat "$XVM_CACHE/wheels/requirements.txt") >> "$WORK/pip.log" 2>&1 \
        || { tail -n 20 "$WORK/pip.log"; die "pip install into the image failed"; }
    rm -rf "$ROOT/tmp/wheels" "$ROOT/root/.cache/pip"

    cp -L "$ROOT/vmlinuz" "$WORK/vmlinuz" && cp -L "$ROOT/initrd.img" "$WORK/initrd.img"
    chmod 644 "$WORK/vmlinuz" "$WORK/initrd.img"
    basename "$(readlink -f "$ROOT/vmlinuz")" | sed 's/^vmlinuz-//' > "$WORK/kernel-version"

    say "ext4 image from the tree (mke2fs -d, no loop mount), then qcow2"
    mke2fs -q -t ext4 -L root -d "$ROOT" -F "$WORK/root.raw" "${DISK_GB}G" 2>&1 | grep -v '^Creating regular file' || true
    qemu-img convert -O qcow2 "$WORK/root.raw" "$WORK/box.img"
    mv "$WORK/vmlinuz" "$WORK/initrd.img" "$WORK/kernel-version" "$WORK/box.img" "$OUT/"
    rm -rf "$WORK"
}

bash scripts/vm_wheels.sh           # (cached) the wheels the image's venv is made from
IMAGE_KEY=$( { declare -f build_image; echo "$PKGS $MIRROR $DISK_GB"; cat "$XVM_CACHE/wheels/stamp"; } \
             | sha256sum | cut -c1-16)
BOX_KEY=$( { echo "$IMAGE_KEY"; cat scripts/vm_box.sh; } | sha256sum | cut -c1-16)
image_ok() { [ "$(cat "$OUT/image.stamp" 2>/dev/null)" = "$IMAGE_KEY" ] && [ -f "$OUT/box.img" ] \
             && [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/initrd.img" ]; }

if [ "${XAGG_VM_REBUILD:-0}" != 1 ] && image_ok && [ "$(cat "$OUT/box.stamp" 2>/dev/null)" = "$BOX_KEY" ]; then
    if vagrant box list 2>/dev/null | grep "^$XVM_BOX " >/dev/null; then
        say "box $XVM_BOX is up to date (cache $OUT, key $BOX_KEY)"
        exit 0
    elif [ -f "$BOXFILE" ]; then
        say "re-adding the cached $BOXFILE to vagrant"
        vagrant box add --force --name "$XVM_BOX" "$BOXFILE" >/dev/null
        exit 0
    fi
fi

bash scripts/vm_setup.sh
T0=$(date +%s)
# a half-built tree may hold a chroot's mounts: undo them on any exit
cleanup() {
    local m
    for m in proc sys dev/pts dev; do
        if mountpoint -q "$ROOT/$m" 2>/dev/null; then umount -l "$ROOT/$m"; fi
    done
    return 0
}
trap cleanup EXIT
if [ "${XAGG_VM_REBUILD:-0}" = 1 ] || ! image_ok; then
    rm -f "$OUT/image.stamp"
    build_image
    echo "$IMAGE_KEY" > "$OUT/image.stamp"
else
    say "image cached (key $IMAGE_KEY): packaging the box only"
fi
KVER=$(cat "$OUT/kernel-version")

# The box: disk, metadata, and a Vagrantfile that boots the kernel kept in the cache.
PKG=$XVM_CACHE/package
rm -rf "$PKG" && mkdir -p "$PKG"
printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %d}\n' "$DISK_GB" > "$PKG/metadata.json"
cat > "$PKG/Vagrantfile" <<EOF
# Box $XVM_BOX (scripts/vm_box.sh, key $BOX_KEY): Debian bookworm, kernel $KVER,
# booted directly (no boot loader on the disk).
Vagrant.configure("2") do |config|
  config.vm.provider :libvirt do |lv|
    lv.driver = "kvm"
    lv.kernel = "$OUT/vmlinuz"
    lv.initrd = "$OUT/initrd.img"
    lv.cmd_line = "root=/dev/vda rw console=ttyS0 net.ifnames=0 biosdevname=0"
  end
end
EOF
ln "$OUT/box.img" "$PKG/box.img" 2>/dev/null || cp "$OUT/box.img" "$PKG/box.img"
tar -C "$PKG" -cf "$BOXFILE.new" metadata.json Vagrantfile box.img
mv "$BOXFILE.new" "$BOXFILE"
rm -rf "$PKG"

say "adding the box to vagrant"
vagrant box add --force --name "$XVM_BOX" "$BOXFILE" >/dev/null
# an older box's volume in the libvirt pool would be reused by name: drop it
remove_box_volumes
echo "$BOX_KEY" > "$OUT/box.stamp"
say "box $XVM_BOX ready in $(( $(date +%s) - T0 )) s: kernel $KVER, $(du -h "$BOXFILE" | cut -f1) ($BOXFILE)"
