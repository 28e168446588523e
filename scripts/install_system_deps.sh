#!/usr/bin/env bash
# Installs the Debian packages the tests use beside the Python ones: libibverbs1, which the Mooncake transfer engine
# wheel (`mooncake` extra) loads (its TCP transport needs no RDMA hardware, but the library must load), and a real
# etcd (etcd-server, etcd-client) for the replicated control plane's tests, Prometheus (`prometheus`: the server
# and promtool) for the observability tests of deploy/observability, and tmux, in which the tests drive `tandem top`.
# Needs root; a no-op when all are there.
set -euo pipefail
missing=()
ldconfig -p | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
command -v etcd >/dev/null || missing+=(etcd-server)
command -v etcdctl >/dev/null || missing+=(etcd-client)
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
command -v tmux >/dev/null || missing+=(tmux)
[ ${#missing[@]} -eq 0 ] && exit 0
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
