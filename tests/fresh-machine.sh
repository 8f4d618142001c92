#!/usr/bin/env bash
# tests/fresh-machine.sh: run the README's test command on a machine that has nothing, to show that
# the project's own set-up (.ci/run, the Makefile, tests/prepare.sh) installs and starts the rest.
#
# Usage (root):  tests/fresh-machine.sh [ROOT] [REPOSITORY]
#   ROOT        the fresh machine's root directory                default /var/tmp/cdgpc-fresh
#   REPOSITORY  a path or URL for `git clone`                     default the repository this
#               script lives in; its committed HEAD, never the working tree
# Environment:
#   MIRROR   the Debian mirror for debootstrap; default: the host's (/etc/apt/sources.list.d/
#            *.sources or /etc/apt/sources.list), and the root gets copies of the host's apt
#            sources; with MIRROR it keeps debootstrap's sources.list for MIRROR alone
#   REV      commit to test                       default: the clone's HEAD
#   SHARED   the shared/ directory laid beside the clone, read-only, as CI lays it
#            default: ../shared beside REPOSITORY when that is a local path and has one
#   PATCH    a diff that `git apply` puts on the clone before the run (to try a fix on a fresh
#            machine without committing it)
#   FRESH=1  build ROOT anew even when it is there
#
# What the fresh root starts with: `debootstrap --variant=minbase` of Debian 12 (the essential
# packages and apt) plus python3 (Debian's 3.11), git and ca-certificates (which brings openssl),
# no recommends: a cloud image as far as the README assumes one, without make, python3-venv,
# PostgreSQL, munge, Slurm, ssh, iproute2 or prometheus. Copied from the host, so that the root
# reaches what this kind of machine reaches: the apt sources (unless MIRROR is set), the pip
# configuration (/etc/pip.conf, /etc/xdg/pip, root's ~/.config/pip and ~/.pip; PIP_* variables
# pass through) with the local package indexes it names bind-mounted read-only, the certificate
# authorities the host adds in /usr/local/share/ca-certificates, /etc/resolv.conf, /etc/hosts,
# /etc/hostname, and /usr/sbin/policy-rc.d where the host has one (this kind of machine's image
# has it: package installs start no service, so the project starts its own).
#
# The run: as root, CI=true, an environment of PATH, HOME, LANG, CI and PIP_* alone, default
# signal dispositions, no standard input, in /work/main of the root with /work/shared beside it;
# the root is a mount point of its own (as / is), with /proc, /sys (and /sys/fs/cgroup), /dev,
# /dev/pts, and tmpfs on /dev/shm, /tmp and /run. Each phase runs in PID, IPC, UTS and network
# namespaces of its own, under tini as PID 1 (it reaps orphans, as init does), so that every
# daemon a phase starts dies with it and none meets the host's: the host's PostgreSQL on
# 127.0.0.1:5432, its munged, sshd and ports are out of reach, in both phases (a package install
# that looks for a free port, as pg_createcluster does, sees the root's own). Two phases, because
# apt and pip need the network and the tests must not have it:
#   1. online, through slirp4netns (user-mode NAT to the outside; the host's loopback is shut
#      off): what .ci/run and `make test` do before any check: install make when missing (as
#      .ci/run does), `bash tests/prepare.sh`, `make .venv/.installed` (the venv and
#      `pip install -e '.[test]'`).
#   2. offline: loopback, and one veth "eth0" with 10.0.2.15/24 and the default route, whose
#      peer is in the same namespace (a host's own non-loopback address; what is sent to it
#      reaches nothing), the nameservers unreachable (a lookup fails at once, as an unknown
#      name does, rather than waiting for a resolver's timeout): `.ci/run`, which runs
#      `make test`. prepare.sh then finds everything installed and only starts services, pip
#      installs nothing (the stamp is newer than setup.cfg), then ruff, mypy and pytest.
# The output goes to ROOT.log (and here); the script prints the last pytest summary line and
# exits with .ci/run's status. On exit every mount is undone and ROOT is left for the next run,
# which skips debootstrap and clones again (it starts with what the last run installed: FRESH=1,
# or rm -r ROOT, starts from nothing). Needs on the host: debootstrap, slirp4netns and tini
# (installed with apt when missing), util-linux, iproute2, git.
set -euo pipefail

SUITE=bookworm
HERE=$(cd "$(dirname "$0")/.." && pwd)
ROOT=$(realpath -m "${1:-/var/tmp/cdgpc-fresh}")
REPOSITORY=${2:-$HERE}
CLONE=/work/main
LOG=$ROOT.log
PATH_IN=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { echo "[fresh-machine] $*" >&2; }
die() { log "ERROR: $*"; exit 2; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, mount, chroot)"
case "$ROOT" in / | /usr | /var | /var/tmp | /tmp | /work) die "refusing ROOT=$ROOT" ;; esac

# The Debian mirror of the host's apt sources for $SUITE: deb822 stanzas, then one-line entries.
host_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" '
            BEGIN { RS = ""; FS = "\n" }
            {
                uris = ""; deb = 0; ours = 0
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^Types:/ && $i ~ /[ \t]deb([ \t]|$)/) deb = 1
                    if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); uris = $i }
                    if ($i ~ /^Suites:/) {
                        n = split($i, s, /[ \t]+/)
                        for (j = 2; j <= n; j++) if (s[j] == suite) ours = 1
                    }
                }
                if (deb && ours && uris != "") { split(uris, u, /[ \t]+/); print u[1]; exit }
            }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; exit }
            }' "$f"
    done
}

# Local directories the pip configuration names (find-links, file:// indexes); an index's
# `simple/` is bound with its parent, where its links point (../../files/...).
pip_dirs() {
    local conf
    {
        for conf in /etc/pip.conf /etc/xdg/pip/pip.conf /root/.config/pip/pip.conf \
            /root/.pip/pip.conf; do
            [ -f "$conf" ] && grep -E '^[[:space:]]*[^#;]' "$conf"
        done
        env | grep -E '^PIP_(FIND_LINKS|INDEX_URL|EXTRA_INDEX_URL)=' || true
    } | grep -oE '(file://)?/[^[:space:]"'\'']+' | sed 's|^file://||; s|/$||' |
        while read -r p; do
            [ "$(basename "$p")" = simple ] && p=$(dirname "$p")
            [ -d "$p" ] && echo "$p"
        done | sort -u
}

# --- mounts, undone on exit -----------------------------------------------------------------------
MOUNTED=()
mnt() { # mnt TARGET MOUNT-ARGS...: mount, keep it private, remember it
    local target=$1
    shift
    mkdir -p "$target"
    mount "$@" "$target"
    mount --make-rprivate "$target"
    MOUNTED+=("$target")
}
bind_ro() { # bind_ro SOURCE TARGET
    mnt "$2" --bind "$1"
    mount -o remount,bind,ro "$2"
}
SLIRP=
NETNS=$ROOT.netns
unmount_netns() {
    [ -z "$SLIRP" ] || { kill "$SLIRP" 2>/dev/null; wait "$SLIRP" 2>/dev/null; SLIRP=; }
    [ -z "$(findmnt -rn "$NETNS" 2>/dev/null)" ] || umount "$NETNS"
    rm -f "$NETNS"
}
unmount_all() {
    local i
    unmount_netns
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount -R "${MOUNTED[$i]}" 2>/dev/null || umount -R -l "${MOUNTED[$i]}" || true
    done
    MOUNTED=()
}
stale_mounts() { findmnt -rn -o TARGET | grep -E "^$ROOT(/|$)" | sort -r || true; }

# One run at a time on one root.
exec 9>"$ROOT.lock"
flock -n 9 || die "another run holds $ROOT.lock"
stale_mounts | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
trap unmount_all EXIT
unmount_all
trap 'exit 130' INT TERM

# --- 1. the fresh root ----------------------------------------------------------------------------
if [ "${FRESH:-0}" = 1 ] && [ -e "$ROOT" ]; then
    [ -z "$(stale_mounts)" ] || die "mounts left under $ROOT; not removing it"
    log "FRESH=1: removing $ROOT"
    rm -rf --one-file-system "$ROOT"
fi
missing=()
for tool in debootstrap slirp4netns tini; do command -v $tool >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    log "installing ${missing[*]} on the host"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ ! -e "$ROOT/.fresh-root" ]; then
    mirror=${MIRROR:-$(host_mirror | head -n 1)}
    [ -n "$mirror" ] || die "no Debian $SUITE mirror in the host's apt sources; set MIRROR"
    partial=$ROOT.partial
    rm -rf --one-file-system "$partial"
    log "debootstrap $SUITE (minbase + python3, git, ca-certificates) into $ROOT"
    debootstrap --variant=minbase --include=python3,git,ca-certificates \
        "$SUITE" "$partial" "$mirror" >"$ROOT.debootstrap.log" 2>&1 ||
        die "debootstrap failed: see $ROOT.debootstrap.log"
    if [ -z "${MIRROR:-}" ]; then
        rm -f "$partial/etc/apt/sources.list"
        [ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$partial/etc/apt/"
        for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
            [ -f "$f" ] && cp "$f" "$partial/etc/apt/sources.list.d/"
        done
    fi
    [ -x /usr/sbin/policy-rc.d ] && cp /usr/sbin/policy-rc.d "$partial/usr/sbin/"
    rm -rf "$ROOT"
    mv "$partial" "$ROOT"
    date -u +%FT%TZ >"$ROOT/.fresh-root"
fi

# What is copied from the host, again on every run (the host's settings may have changed).
for f in /etc/resolv.conf /etc/hosts /etc/hostname; do
    [ -f "$f" ] && cp -L "$f" "$ROOT$f"
done
rm -rf "$ROOT/etc/xdg/pip" "$ROOT/etc/pip.conf" "$ROOT/root/.config/pip" "$ROOT/root/.pip"
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$ROOT/etc/"
[ -d /etc/xdg/pip ] && mkdir -p "$ROOT/etc/xdg" && cp -r /etc/xdg/pip "$ROOT/etc/xdg/"
[ -d /root/.config/pip ] && mkdir -p "$ROOT/root/.config" &&
    cp -r /root/.config/pip "$ROOT/root/.config/"
[ -d /root/.pip ] && cp -r /root/.pip "$ROOT/root/"
# the certificate authorities this machine adds to Debian's (its way out to the registries)
rm -rf "$ROOT/usr/local/share/ca-certificates"
mkdir -p "$ROOT/usr/local/share/ca-certificates"
cp -r /usr/local/share/ca-certificates/. "$ROOT/usr/local/share/ca-certificates/"
chroot "$ROOT" update-ca-certificates --fresh >/dev/null 2>&1 ||
    die "update-ca-certificates failed in $ROOT"

# --- 2. mounts ------------------------------------------------------------------------------------
mnt "$ROOT" --bind "$ROOT" # `ip netns exec` remounts / (--make-rslave): it must be a mount
mnt "$ROOT/proc" -t proc proc
mnt "$ROOT/sys" --rbind /sys # with /sys/fs/cgroup: slurmd initialises its cgroup plugin
mnt "$ROOT/dev" --bind /dev
mnt "$ROOT/dev/pts" --bind /dev/pts
mnt "$ROOT/dev/shm" -t tmpfs -o mode=1777,nosuid,nodev tmpfs
mnt "$ROOT/tmp" -t tmpfs -o mode=1777 tmpfs
mnt "$ROOT/run" -t tmpfs -o mode=0755,nosuid,nodev tmpfs
while read -r dir; do
    [ -n "$dir" ] && bind_ro "$dir" "$ROOT$dir"
done < <(pip_dirs)

# --- 3. the clone ---------------------------------------------------------------------------------
rm -rf --one-file-system "$ROOT$CLONE"
mkdir -p "$(dirname "$ROOT$CLONE")"
git clone --quiet --no-hardlinks "$REPOSITORY" "$ROOT$CLONE"
[ -z "${REV:-}" ] || git -C "$ROOT$CLONE" checkout --quiet --detach "$REV"
commit=$(git -C "$ROOT$CLONE" rev-parse --short HEAD)
log "testing $commit of $REPOSITORY in $ROOT$CLONE"
if [ -n "${PATCH:-}" ]; then
    git -C "$ROOT$CLONE" apply --verbose "$(realpath "$PATCH")"
    log "with $PATCH applied: $(git -C "$ROOT$CLONE" diff --stat | tail -n 1)"
fi

shared=${SHARED:-}
if [ -z "$shared" ] && [ -d "$REPOSITORY" ] && [ -d "$(realpath "$REPOSITORY")/../shared" ]; then
    shared=$(realpath "$REPOSITORY/../shared")
fi
if [ -n "$shared" ]; then
    bind_ro "$shared" "$ROOT$(dirname "$CLONE")/shared"
else
    log "no shared/ beside the clone (set SHARED): the tests of the third-party data fail under CI"
fi

# --- 4. the run -----------------------------------------------------------------------------------
# The environment CI gives: root, CI=true, the machine's PIP_* settings, nothing else.
envv=(HOME=/root PATH="$PATH_IN" LANG=C.UTF-8 CI=true)
while IFS= read -r kv; do envv+=("$kv"); done < <(env | grep -E '^PIP_[A-Z_]+=' || true)
netns() { nsenter --net="$NETNS" "$@"; }
phase() { # phase online|offline SCRIPT: run SCRIPT in the root, in /work/main; its status
    local status
    : >"$NETNS"
    unshare --net="$NETNS" true
    netns ip link set lo up
    if [ "$1" = online ]; then
        slirp4netns --configure --mtu=65520 --disable-host-loopback --netns-type=path \
            "$NETNS" tap0 >>"$ROOT.slirp.log" 2>&1 &
        SLIRP=$!
        for _ in $(seq 100); do
            netns ip -4 route show default | grep -q . && break
            sleep 0.1
        done
        netns ip -4 route show default | grep -q . ||
            die "slirp4netns did not come up: see $ROOT.slirp.log"
    else
        netns sh -c 'ip link add eth0 type veth peer name eth0-peer && ip link set eth0-peer up &&
            ip addr add 10.0.2.15/24 dev eth0 && ip link set eth0 up &&
            ip route add default dev eth0' || die "cannot give the offline namespace its eth0"
        # the nameservers refuse at once, as a name a resolver does not know fails: no lookup
        # waits for its timeout
        awk '$1 == "nameserver" && $2 ~ /^[0-9.]+$/ { print $2 }' "$ROOT/etc/resolv.conf" |
            while read -r ns; do netns ip route add unreachable "$ns/32"; done
    fi
    set +e
    netns unshare --pid --fork --kill-child --ipc --uts --mount-proc="$ROOT/proc" \
        tini -- env --default-signal chroot "$ROOT" \
        env -i "${envv[@]}" bash -c "cd $CLONE && $2" </dev/null 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    set -e
    unmount_netns
    return "$status"
}

: >"$LOG"
log "phase 1 (online): make, tests/prepare.sh, make .venv/.installed; log $LOG"
status=0
phase online 'set -e
    command -v make >/dev/null || { apt-get update -qq && apt-get install -y -qq make; }
    bash tests/prepare.sh
    make .venv/.installed' || status=$?
[ "$status" = 0 ] || die "phase 1 (set-up) exited with $status: see $LOG"

log "phase 2 (offline): .ci/run"
status=0
phase offline 'exec .ci/run' || status=$?

# --- 5. the outcome -------------------------------------------------------------------------------
pytest_line='^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s'
summary=$(grep -aE "$pytest_line" "$LOG" | tail -n 1 || true)
log "commit $commit${PATCH:+ with $PATCH}: ${summary:-no pytest summary line}"
log ".ci/run exited with $status"
exit "$status"
