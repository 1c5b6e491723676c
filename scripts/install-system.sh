#!/usr/bin/env bash
# Debian packages, installed where missing (apt-get, as root; through sudo when not root).
#   install-system.sh          what the tests need: sshd for fake Proxmox hosts, LXC and
#                              debootstrap for real containers, bubblewrap/iproute2 for namespaces,
#                              tmux for launched runs
#   install-system.sh demo     what the demo on the `local` target needs: tmux, python3-venv
set -euo pipefail
case "${1:-tests}" in
  demo) packages=(tmux python3 python3-venv python3-pip ca-certificates) ;;
  tests) packages=(openssh-server openssh-client iproute2 lxc debootstrap bubblewrap
                   busybox-static rsync tmux python3 python3-venv python3-pip ca-certificates git) ;;
  *) echo "install-system: unknown profile '$1': expected demo or tests" >&2; exit 2 ;;
esac
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]})) || exit 0
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null; then
  as_root=(sudo)
else
  echo "install-system: need root to install: ${missing[*]} (run as root, or install them)" >&2
  exit 1
fi
echo "install-system: apt-get install ${missing[*]}" >&2
"${as_root[@]}" apt-get update -q >&2
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
