#!/usr/bin/env bash
# Local SGD and DiLoCo beside per-step synchronous training on emulated hosts at slow link rates
# (scripts/bench/slow_links.py says what it runs and reports; --help lists every option).
#
#   sudo scripts/bench/slow-links.sh                                   # 4 hosts, 50mbit and unshaped
#   sudo scripts/bench/slow-links.sh --hosts 2 --links 1gbit,unshaped  # 2 hosts at 1 Gbit/s
#
# Root for the namespaces and tc; one run at a time (the lock hosts.sh takes, whose namespaces it
# shares); every process and namespace is removed on any exit.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
for a in "$@"; do
    case "$a" in -h | --help | --render | --render=*) exec "$PY" scripts/bench/slow_links.py "$@" ;; esac
done
source scripts/bench/emulated-hosts.sh
emulated_hosts slow-links.sh slow_links.py "$@"
