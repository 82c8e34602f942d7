# Shared by scripts/vm_*.sh (sourced): names, the cache, libvirt start/stop.
# Everything the VM targets make is named with the prefix "xvm".
XVM_CACHE=${XAGG_VM_CACHE:-/var/cache/xagg-vm}   # box, debs, wheels, libvirt pool: kept between runs
XVM_BOX=xvm-bookworm                            # the box vm_box.sh builds
XVM_POOL=xvm                                    # libvirt storage pool (box volume + VM disks)
export LIBVIRT_DEFAULT_URI=qemu:///system

say() { printf '[%s] %s\n' "${XVM_STEP_TAG:-vm}" "$*"; }
die() { printf '[%s] ERROR: %s\n' "${XVM_STEP_TAG:-vm}" "$*" >&2; exit 1; }

mkdir -p "$XVM_CACHE" && chmod 755 "$XVM_CACHE"    # qemu (libvirt-qemu) reads the kernel here

vagrant_insecure_pub() {
    local f
    f=$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | sort -V | tail -n1)
    [ -n "$f" ] || f=$(find / -xdev -path '*/vagrant*/keys/vagrant.pub' 2>/dev/null | head -n1)
    [ -n "$f" ] || die "Vagrant's insecure public key (keys/vagrant.pub) not found"
    echo "$f"
}

# libvirtd and virtlogd: no init system here, so started by hand. Each start
# is recorded in XVM_STARTED so that stop_libvirt stops only what we started.
XVM_STARTED=""
start_libvirt() {
    if ! pgrep -x virtlogd >/dev/null; then
        virtlogd -d 9>&- && XVM_STARTED="$XVM_STARTED virtlogd"     # (9: vm_test.sh's lock, not for daemons)
    fi
    if ! pgrep -x libvirtd >/dev/null; then
        libvirtd -d 9>&- && XVM_STARTED="$XVM_STARTED libvirtd"     # (9: vm_test.sh's lock, not for daemons)
    fi
    local i
    for i in $(seq 60); do virsh -q version >/dev/null 2>&1 && break; sleep 0.5; done
    virsh -q version >/dev/null 2>&1 || die "libvirtd did not answer on $LIBVIRT_DEFAULT_URI"
    if ! virsh pool-info "$XVM_POOL" >/dev/null 2>&1; then
        mkdir -p "$XVM_CACHE/pool"
        virsh -q pool-define-as "$XVM_POOL" dir --target "$XVM_CACHE/pool" >/dev/null
        virsh -q pool-autostart "$XVM_POOL" >/dev/null
    fi
    virsh -q pool-start "$XVM_POOL" >/dev/null 2>&1 || true    # (autostart may have beaten us to it)
    virsh pool-info "$XVM_POOL" | grep running >/dev/null || die "libvirt storage pool $XVM_POOL did not start"
    virsh -q pool-refresh "$XVM_POOL" >/dev/null
    say "libvirt up${XVM_STARTED:+ (started:$XVM_STARTED)}"
}

stop_libvirt() {
    local d pid
    for d in libvirtd virtlogd; do
        case " $XVM_STARTED " in *" $d "*) ;; *) continue ;; esac
        pid=$(cat "/run/$d.pid" 2>/dev/null || true)
        if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
            for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
            say "stopped $d (pid $pid), which this run started"
        fi
    done
    XVM_STARTED=""
}

# The box's volume in the pool, uploaded on first `vagrant up`: a rebuilt box
# has the same name, so the old volume must go or it would be booted instead.
remove_box_volumes() {
    rm -f "$XVM_CACHE/pool/${XVM_BOX}_vagrant_box_image_"*
    if virsh -q version >/dev/null 2>&1 && virsh pool-info "$XVM_POOL" >/dev/null 2>&1; then
        virsh -q pool-refresh "$XVM_POOL" >/dev/null 2>&1 || true
    fi
}

# Put the box's disk into the pool under the name vagrant-libvirt looks for
# (box, version 0, the image's mtime), so `vagrant up` finds it there instead
# of streaming gigabytes through the libvirt API (minutes). A hard link on
# the same filesystem; the VMs' disks are copy-on-write overlays of it.
preload_box_volume() {
    local img vol
    img=${VAGRANT_HOME:-$HOME/.vagrant.d}/boxes/$XVM_BOX/0/libvirt/box.img
    [ -f "$img" ] || return 0
    vol=$XVM_CACHE/pool/${XVM_BOX}_vagrant_box_image_0_$(stat -c %Y "$img")_box.img
    [ -f "$vol" ] && return 0
    remove_box_volumes
    mkdir -p "$XVM_CACHE/pool"
    ln "$img" "$vol" 2>/dev/null || cp --sparse=always "$img" "$vol"
    if virsh -q version >/dev/null 2>&1; then virsh -q pool-refresh "$XVM_POOL" >/dev/null; fi
    say "box volume in pool $XVM_POOL: $(basename "$vol")"
}
