#!/usr/bin/env bash
# The click model's parameter-server jobs (2 ps tasks, 2 workers, a host each) at a shaped link
# rate beside the same jobs unshaped (scripts/bench/ctr_hosts.py says what it runs and reports;
# --help lists every option).
#
#   sudo scripts/bench/ctr-hosts.sh                                # hybrid and async, 1gbit and unshaped
#   sudo scripts/bench/ctr-hosts.sh --modes hybrid --rounds 5
#
# Root for the namespaces and tc; one run at a time (the lock hosts.sh takes, whose namespaces it
# shares); every process and namespace is removed on any exit.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
for a in "$@"; do
    case "$a" in -h | --help) exec "$PY" scripts/bench/ctr_hosts.py "$@" ;; esac
done
source scripts/bench/emulated-hosts.sh
emulated_hosts ctr-hosts.sh ctr_hosts.py "$@"
