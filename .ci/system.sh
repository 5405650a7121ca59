#!/usr/bin/env bash
# What the tests need from the system (as root): iproute2's `ip` (tests/hosts makes network namespaces) and
# etcd 3.4 (the etcd-backed registry's tests start real etcd clusters; openssl makes their TLS certificates).
# Installs only what is missing.
set -euo pipefail
if ! command -v ip >/dev/null || ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null || ! command -v openssl >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 etcd-server etcd-client openssl
fi
