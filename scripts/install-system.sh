#!/usr/bin/env bash
# Debian packages the tests need: sshd for fake Proxmox hosts, LXC and debootstrap for real
# containers, bubblewrap/iproute2 for namespaces, tmux for launched runs.
set -euo pipefail
packages=(openssh-server openssh-client iproute2 lxc debootstrap bubblewrap busybox-static
          rsync tmux python3 python3-venv ca-certificates git)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "install-system: need root to install: ${missing[*]}" >&2; exit 1
  fi
  echo "install-system: apt-get install ${missing[*]}" >&2
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
