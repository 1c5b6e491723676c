#!/usr/bin/env bash
# Try a README command the way a new user would: on a minimal Debian 12 (debootstrap minbase
# plus git and python3, nothing else) in a chroot, from a fresh clone of this checkout.
#
#   sudo ./scripts/fresh-debian.sh [COMMAND]      COMMAND defaults to ./scripts/demo.sh
#
# Needs root and debootstrap on this machine. FRESH_DIR (default /var/tmp/dflashops-fresh) holds
# the chroot, rebuilt on every call. FRESH_BIND: colon-separated paths of this machine bound at
# the same place inside, or PATH=INSIDE elsewhere (e.g. a local pip mirror, its pip.conf); PIP_*
# variables pass through. A CA bundle (a file named *.crt or *.pem, e.g. a proxy's,
# FRESH_BIND=/etc/ssl/certs/ca-certificates.crt) is bound at a path of its own inside
# (/opt/fresh-ca/NAME: apt's ca-certificates rewrites /etc/ssl/certs, which a bind mount there
# would break), and SSL_CERT_FILE, REQUESTS_CA_BUNDLE, PIP_CERT, GIT_SSL_CAINFO and apt's
# Acquire::https::CAInfo name it.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${FRESH_DIR:-/var/tmp/dflashops-fresh}
COMMAND=${1:-./scripts/demo.sh}
MIRROR=${FRESH_MIRROR:-$(grep -rhoE '(^deb\s+|URIs:\s*)https?://\S*debian\S*' \
  /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null | grep -v security | head -1 |
  awk '{print $NF}' || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || { echo "fresh-debian: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "fresh-debian: needs root (chroot, mounts)" >&2; exit 1; }

mounts=()
cleanup() {
  for ((i=${#mounts[@]}-1; i>=0; i--)); do umount -l "${mounts[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() { mkdir -p "$DIR$2"; mount "${@:3}" "$1" "$DIR$2"; mounts+=("$DIR$2"); }

if awk -v d="$DIR/" 'index($2, d) == 1 {found=1} END {exit !found}' /proc/mounts; then
  echo "fresh-debian: something is still mounted under $DIR (an earlier run?): unmount it first" >&2
  exit 1
fi
rm -rf "$DIR"
echo "fresh-debian: debootstrap bookworm (minbase + git, python3) into $DIR from $MIRROR" >&2
t0=$SECONDS
debootstrap --variant=minbase --include=git,python3 bookworm "$DIR" "$MIRROR" >/dev/null
echo "fresh-debian: chroot ready in $((SECONDS - t0))s" >&2
cp /etc/resolv.conf "$DIR/etc/resolv.conf"
bind proc /proc -t proc
bind sysfs /sys -t sysfs
bind /dev /dev --rbind
bind tmpfs /run -t tmpfs
IFS=: read -r -a extra <<<"${FRESH_BIND:-}"
ca=()
for entry in "${extra[@]}"; do
  path=${entry%%=*} inside=${entry#*=}  # PATH, or PATH=WHERE-INSIDE
  [ -e "$path" ] || continue
  case "$path" in
    *.crt|*.pem) [ -f "$path" ] || continue
      inside=/opt/fresh-ca/$(basename "$path")
      ca=(SSL_CERT_FILE="$inside" REQUESTS_CA_BUNDLE="$inside" PIP_CERT="$inside" GIT_SSL_CAINFO="$inside")
      echo "Acquire::https::CAInfo \"$inside\";" >"$DIR/etc/apt/apt.conf.d/99fresh-ca" ;;
  esac
  if [ -d "$path" ]; then mkdir -p "$DIR$inside"; else mkdir -p "$(dirname "$DIR$inside")"; touch "$DIR$inside"; fi
  mount --bind "$path" "$DIR$inside"; mounts+=("$DIR$inside")
done
git clone -q "$REPO" "$DIR/root/dflashops"
pass=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
      TERM="${TERM:-dumb}" LANG=C.UTF-8)
while IFS= read -r var; do pass+=("$var"); done < <(env | grep -E '^(PIP_|TORCH_INDEX=)' || true)
pass+=("${ca[@]}")  # after PIP_*: an outside PIP_CERT names a path that inside is apt's bundle
echo "fresh-debian: running $COMMAND in the chroot" >&2
t1=$SECONDS
set +e
chroot "$DIR" /usr/bin/env -i "${pass[@]}" /bin/bash -c "cd /root/dflashops && $COMMAND"
rc=$?
set -e
echo "fresh-debian: '$COMMAND' exited $rc after $((SECONDS - t1))s" >&2
exit $rc
