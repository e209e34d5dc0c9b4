#!/bin/sh
# Makes the aws-ofi-nccl plugin that AWS's EFA installer put under /opt/amazon/ofi-nccl loadable by NCCL,
# which dlopen()s "libnccl-net.so" (NCCL_NET_PLUGIN unset). Debian and Ubuntu installs put the plugin in
# lib/<multiarch>/ (x86_64-linux-gnu), not lib/, and name it libnccl-net-ofi.so in recent versions; and
# ld.so.cache files a library under its SONAME, not its file name, so registering the folder alone does not
# make the name "libnccl-net.so" resolve. A link by that name in the system's library folder does (the
# loader looks there by file name). The EFA and plugin folders go to ld.so.conf for the plugin's own
# dependencies (libfabric). Fails the build when there is no plugin to register.
set -eu
prefix=/opt/amazon/ofi-nccl
libdir=/usr/lib/$(uname -m)-linux-gnu
plugin=$(find "$prefix" \( -name 'libnccl-net-ofi.so' -o -name 'libnccl-net.so' -o -name 'libnccl-net-aws-ofi.so' \) 2>/dev/null | sort | head -n 1)
if [ -z "$plugin" ]; then
    echo "register-ofi-nccl: no aws-ofi-nccl plugin (libnccl-net*.so) under $prefix: the EFA installer did not install it; pick an EFA_INSTALLER_VERSION that bundles aws-ofi-nccl" >&2
    exit 1
fi
plugin=$(readlink -f "$plugin")
ln -sfn "$plugin" "$libdir/libnccl-net.so"
printf '%s\n' /opt/amazon/efa/lib "$(dirname "$plugin")" > /etc/ld.so.conf.d/ddpack-efa.conf
ldconfig
echo "register-ofi-nccl: $libdir/libnccl-net.so -> $plugin"
