#!/bin/sh
# AWS EFA for multi-node NCCL on p4d/p5: runs AWS's EFA installer (libfabric + EFA provider, and the
# aws-ofi-nccl plugin that recent installers bundle) without kernel modules or limits, which belong
# to the host. Untested on ddpack's CI: the installer's download host is not reachable there.
#   $1: EFA installer version (pinned by the Dockerfile's EFA_INSTALLER_VERSION)
set -eu
version=$1
cacert=""
[ -s /run/secrets/pip_cert ] && cacert="--cacert /run/secrets/pip_cert"
apt-get update
apt-get install -y --no-install-recommends curl ca-certificates libhwloc15 pciutils
tmp=$(mktemp -d)
cd "$tmp"
# shellcheck disable=SC2086
curl -fsSL --retry 3 $cacert -o efa.tar.gz "https://efa-installer.amazonaws.com/aws-efa-installer-${version}.tar.gz"
tar -xf efa.tar.gz
cd aws-efa-installer
./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify
sh /tmp/register-ofi-nccl.sh  # NCCL finds the plugin as libnccl-net.so (see that script)
cd /
rm -rf "$tmp" /var/lib/apt/lists/*
