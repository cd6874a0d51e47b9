#!/usr/bin/env bash
# An emulated aarch64 board on an x86-64 Debian host: a Debian trixie arm64 root (Python 3.13,
# as on Raspberry Pi OS) run under QEMU user-mode emulation, with edgert's board runtime installed
# from this checkout the way a board installs it (stock onnxruntime from the package index).
#
#   arm64-root.sh build      build the root once and cache it (about 8 minutes, 800 MB), then install
#   arm64-root.sh install    (re)install the board runtime from this checkout into the root's venv
#   arm64-root.sh run CMD..  run CMD inside the root (mounts what it needs; /opt/edgert/bin is on PATH)
#   arm64-root.sh status     print the root's folder and whether it is built and installed
#   arm64-root.sh unmount    unmount /proc/cpuinfo, /proc, /dev, /sys of the root
#
# Environment: EDGERT_ARM_ROOT (default ~/.cache/edgert/arm64-trixie), EDGERT_ARM_SUITE (trixie),
# EDGERT_ARM_MIRROR (http://deb.debian.org/debian). Needs root (chroot, mount) and, the first time,
# apt access for qemu-user-static, debootstrap and binfmt-support. See platforms/emulated/README.md.
set -euo pipefail

ROOT=${EDGERT_ARM_ROOT:-${HOME:-/root}/.cache/edgert/arm64-trixie}
SUITE=${EDGERT_ARM_SUITE:-trixie}
MIRROR=${EDGERT_ARM_MIRROR:-http://deb.debian.org/debian}
CHECKOUT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=/opt/edgert
CA=/etc/ssl/certs/ca-certificates.crt
CORES=4

say() { printf 'arm64-root: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

need_root() { [[ $(id -u) == 0 ]] || die "must run as root (chroot and mount need it)"; }

host_packages() {
    local missing=()
    command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v update-binfmts >/dev/null || missing+=(binfmt-support)
    if ((${#missing[@]})); then
        say "installing ${missing[*]} (apt)"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# The kernel must hand aarch64 binaries to qemu; the F flag makes that work inside the chroot.
binfmt() {
    if [[ ! -e /proc/sys/fs/binfmt_misc/status ]]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    [[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]] || update-binfmts --enable qemu-aarch64 >/dev/null
    grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || die "qemu-aarch64 is registered without the F flag; binaries in the root will not find qemu"
}

# onnxruntime's CPU probe reads /proc/cpuinfo and crashes on the x86 host's: show it a Cortex-A72.
cpuinfo() {
    local i
    for ((i = 0; i < CORES; i++)); do
        printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n' "$i"
        printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n'
    done
}

is_mounted() { mountpoint -q "$1"; }

mount_all() {
    binfmt
    is_mounted "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    is_mounted "$ROOT/sys" || mount --rbind /sys "$ROOT/sys"
    is_mounted "$ROOT/dev" || mount --rbind /dev "$ROOT/dev"
    cpuinfo > "$ROOT/etc/edgert-cpuinfo"
    grep -q 'CPU part' "$ROOT/proc/cpuinfo" 2>/dev/null || mount --bind "$ROOT/etc/edgert-cpuinfo" "$ROOT/proc/cpuinfo"
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    cp "$CA" "$ROOT/etc/edgert-host-ca.crt"
}

unmount_all() {
    local point
    for point in "$ROOT/proc/cpuinfo" "$ROOT/proc" "$ROOT/dev" "$ROOT/sys"; do
        while is_mounted "$point"; do umount -l "$point"; done
    done
}

# A clean environment: nothing of the host's venv or PYTHONPATH leaks into the board.
ROOT_ENV=(QEMU_CPU=cortex-a72 LC_ALL=C.UTF-8 PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
          HOME=/root TERM=dumb PYTHONUNBUFFERED=1 PIP_CERT=/etc/edgert-host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1)

in_root() {
    mount_all
    env -i "${ROOT_ENV[@]}" "$(command -v chroot)" "$ROOT" "$@"
}

# The command replaces this script, so a signal sent to this process reaches it (edgert worker stops on SIGTERM).
exec_in_root() {
    mount_all
    exec env -i "${ROOT_ENV[@]}" "$(command -v chroot)" "$ROOT" "$@"
}

build() {
    need_root
    if [[ -f $ROOT/.edgert-built ]]; then
        say "root already built at $ROOT ($(cat "$ROOT/.edgert-built"))"
    else
        host_packages
        binfmt
        local started=$SECONDS
        if [[ ! -f $ROOT/.edgert-base ]]; then  # a root left half-built by an interrupted build is rebuilt
            unmount_all 2>/dev/null || true
            rm -rf "$ROOT"
            mkdir -p "$ROOT"
            say "debootstrap $SUITE arm64 (first stage) into $ROOT"
            debootstrap --arch=arm64 --variant=minbase --foreign "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 \
                || die "debootstrap failed; see $ROOT.log"
            say "second stage, under emulation (about 3 minutes)"
            chroot "$ROOT" /debootstrap/debootstrap --second-stage >>"$ROOT.log" 2>&1 \
                || die "debootstrap second stage failed; see $ROOT/debootstrap/debootstrap.log"
            touch "$ROOT/.edgert-base"
        fi
        say "python3, venv, pip (about 3 minutes)"
        in_root bash -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends python3 python3-venv python3-pip ca-certificates" >>"$ROOT.log" 2>&1 \
            || die "apt-get inside the root failed; see $ROOT.log"
        in_root python3 -m venv "$VENV"
        in_root python3 --version > "$ROOT/.edgert-built"
        say "root built in $((SECONDS - started)) s: $(cat "$ROOT/.edgert-built")"
    fi
    install
}

# What a board does: pip install the board extra, which pulls stock onnxruntime and never the training build.
install() {
    need_root
    [[ -f $ROOT/.edgert-built ]] || die "no root at $ROOT: run '$0 build' first"
    local started=$SECONDS stamp
    stamp=$(cd "$CHECKOUT" && { git rev-parse HEAD 2>/dev/null; git status --porcelain 2>/dev/null; \
        find pyproject.toml edgert transport -name '*.py' -o -name '*.toml' | sort | xargs cat; } | sha256sum | cut -c1-16)
    if [[ -f $ROOT/.edgert-installed && $(cat "$ROOT/.edgert-installed") == "$stamp" ]]; then
        say "board runtime already installed from this checkout ($stamp)"
        return
    fi
    say "copying the checkout into the root"
    rm -rf "$ROOT/src/edgert"
    mkdir -p "$ROOT/src/edgert"
    (cd "$CHECKOUT" && tar --exclude-vcs --exclude='*.egg-info' --exclude=__pycache__ --exclude='.venv*' \
        --exclude=build -cf - pyproject.toml README.md edgert transport exporter models) | tar -xf - -C "$ROOT/src/edgert"
    say "pip install '/src/edgert[board]' inside the root"
    in_root "$VENV/bin/pip" install -q --force-reinstall --no-cache-dir "/src/edgert[board]" >>"$ROOT.log" 2>&1 \
        || die "pip install inside the root failed; see $ROOT.log"
    if in_root "$VENV/bin/pip" show -q onnxruntime-training-cpu >/dev/null 2>&1; then
        die "the training build got installed into the board root"
    fi
    in_root "$VENV/bin/python" -c "import onnxruntime, edgert.worker.worker; print('onnxruntime', onnxruntime.__version__)" \
        || die "the board runtime does not import inside the root"
    echo "$stamp" > "$ROOT/.edgert-installed"
    say "installed in $((SECONDS - started)) s"
}

status() {
    echo "root: $ROOT"
    if [[ -f $ROOT/.edgert-built ]]; then echo "built: $(cat "$ROOT/.edgert-built")"; else echo "built: no"; fi
    if [[ -f $ROOT/.edgert-installed ]]; then echo "installed: $(cat "$ROOT/.edgert-installed")"; else echo "installed: no"; fi
}

case ${1:-} in
    build) build ;;
    install) install ;;
    run) shift; need_root; [[ -f $ROOT/.edgert-built ]] || die "no root at $ROOT: run '$0 build' first"
         exec_in_root "$@" ;;
    status) status ;;
    unmount) need_root; unmount_all ;;
    *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
