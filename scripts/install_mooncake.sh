#!/usr/bin/env bash
# Installs the system library the Mooncake transfer engine wheel (`mooncake` extra) needs: Debian's libibverbs1
# (the TCP transport runs without RDMA hardware, but the library must load). Needs root; no-op when present.
set -euo pipefail
if ldconfig -p | grep -q 'libibverbs\.so\.1'; then exit 0; fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1
