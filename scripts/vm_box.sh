#!/usr/bin/env bash
# `make vm-box`: a Debian bookworm Vagrant box for vagrant-libvirt, built from
# Debian packages alone (no box catalogue, no cloud image):
#   debootstrap -> root tree with sshd, the vagrant user (Vagrant's insecure key,
#   which vagrant swaps for a fresh one on first boot), ifupdown, the kernel,
#   and every apt package scripts/setup.sh wants (the VMs have no way out to
#   a mirror) -> ext4 filled straight from the tree (mke2fs -d, no loop mount)
#   -> qcow2 -> a .box added to vagrant as "xvm-bookworm".
# The VMs boot the box's kernel and initrd directly (libvirt <kernel>/<initrd>),
# so the disk needs no partition table or boot loader.
# Cached: a second run with the same inputs (this script, setup.sh's package
# list) only checks and returns. XAGG_VM_REBUILD=1 forces a rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/vm_common.sh

MIRROR=${XAGG_VM_MIRROR:-http://deb.debian.org/debian}
DISK_GB=${XAGG_VM_DISK_GB:-12}
# The project's own apt list (scripts/setup.sh), so provisioning finds it installed.
SETUP_PKGS=$(sed -n 's/^APT_PKGS="\(.*\)"/\1/p' scripts/setup.sh)
[ -n "$SETUP_PKGS" ] || die "could not read APT_PKGS from scripts/setup.sh"
BASE_PKGS="systemd-sysv udev dbus kmod openssh-server sudo ifupdown isc-dhcp-client
           linux-image-amd64 initramfs-tools ca-certificates python3 python3-venv make gcc libc6-dev
           rsync less"
PKGS=$(echo $BASE_PKGS $SETUP_PKGS | tr ' ' '\n' | sort -u | paste -sd, -)

KEY=$( { cat scripts/vm_box.sh; echo "$PKGS $MIRROR $DISK_GB"; } | sha256sum | cut -c1-16)
OUT=$XVM_CACHE/box
BOXFILE=$OUT/$XVM_BOX.box

if [ "${XAGG_VM_REBUILD:-0}" != 1 ] && [ "$(cat "$OUT/stamp" 2>/dev/null)" = "$KEY" ] \
        && [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/initrd.img" ]; then
    if vagrant box list 2>/dev/null | grep -q "^$XVM_BOX "; then
        say "box $XVM_BOX is up to date (cache $OUT, key $KEY)"
        exit 0
    elif [ -f "$BOXFILE" ]; then
        say "re-adding the cached $BOXFILE to vagrant"
        vagrant box add --force --name "$XVM_BOX" "$BOXFILE" >/dev/null
        exit 0
    fi
fi

bash scripts/vm_setup.sh
T0=$(date +%s)
WORK=$XVM_CACHE/build
ROOT=$WORK/root
rm -rf "$WORK" && mkdir -p "$WORK" "$XVM_CACHE/debs" "$OUT"
# a half-built tree may hold a chroot's mounts: undo them on any exit
cleanup() {
    for m in proc sys dev/pts dev; do mountpoint -q "$ROOT/$m" 2>/dev/null && umount -l "$ROOT/$m"; done
    return 0
}
trap cleanup EXIT

say "debootstrap bookworm from $MIRROR ($(echo "$PKGS" | tr ',' ' ' | wc -w) extra packages; debs cached in $XVM_CACHE/debs)"
debootstrap --variant=minbase --cache-dir="$XVM_CACHE/debs" --include="$PKGS" \
    bookworm "$ROOT" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -n 30 "$WORK/debootstrap.log"; die "debootstrap failed (log: $WORK/debootstrap.log)"; }

say "configuring the image"
echo xvm > "$ROOT/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 xvm\n' > "$ROOT/etc/hosts"
echo "/dev/vda / ext4 defaults,noatime 0 1" > "$ROOT/etc/fstab"
cat > "$ROOT/etc/network/interfaces" <<'EOF'
# eth0: the Vagrant management network (DHCP). Vagrant appends the private network.
source /etc/network/interfaces.d/*
auto lo
iface lo inet loopback
allow-hotplug eth0
iface eth0 inet dhcp
EOF
# each VM its own machine id and ssh host keys (generated at first boot)
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
# serial console for the boot log; no getty on tty1 (no screen)
chroot "$ROOT" systemctl enable serial-getty@ttyS0.service >/dev/null 2>&1 || true
chroot "$ROOT" systemctl mask getty@tty1.service apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1 || true
chroot "$ROOT" apt-get clean

cp -L "$ROOT/vmlinuz" "$OUT/vmlinuz.new" && cp -L "$ROOT/initrd.img" "$OUT/initrd.img.new"
chmod 644 "$OUT/vmlinuz.new" "$OUT/initrd.img.new"
KVER=$(basename "$(readlink -f "$ROOT/vmlinuz")" | sed 's/^vmlinuz-//')
cleanup

say "ext4 image from the tree (mke2fs -d), then qcow2"
mke2fs -q -t ext4 -L root -d "$ROOT" -F "$WORK/root.raw" "${DISK_GB}G"
qemu-img convert -O qcow2 "$WORK/root.raw" "$WORK/box.img"
rm -f "$WORK/root.raw"

# The box: disk, metadata, and a Vagrantfile that boots the kernel kept beside the cache.
cat > "$WORK/metadata.json" <<EOF
{"provider": "libvirt", "format": "qcow2", "virtual_size": $DISK_GB}
EOF
cat > "$WORK/Vagrantfile" <<EOF
# Box $XVM_BOX (scripts/vm_box.sh, key $KEY): Debian bookworm, kernel $KVER,
# booted directly (no boot loader on the disk).
Vagrant.configure("2") do |config|
  config.vm.provider :libvirt do |lv|
    lv.driver = "kvm"
    lv.kernel = "$OUT/vmlinuz"
    lv.initrd = "$OUT/initrd.img"
    lv.cmdline = "root=/dev/vda rw console=ttyS0 net.ifnames=0 biosdevname=0 quiet"
  end
end
EOF
tar -C "$WORK" -cf "$BOXFILE.new" metadata.json Vagrantfile box.img
mv "$OUT/vmlinuz.new" "$OUT/vmlinuz"; mv "$OUT/initrd.img.new" "$OUT/initrd.img"
mv "$BOXFILE.new" "$BOXFILE"
rm -rf "$WORK"

say "adding the box to vagrant"
vagrant box add --force --name "$XVM_BOX" "$BOXFILE" >/dev/null
# an older box's volume in the libvirt pool would be reused by name: drop it
remove_box_volumes
echo "$KEY" > "$OUT/stamp"
say "box $XVM_BOX built in $(( $(date +%s) - T0 )) s: kernel $KVER, $(du -h "$BOXFILE" | cut -f1) ($BOXFILE)"
