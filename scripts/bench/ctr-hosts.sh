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
if [[ $(id -u) -ne 0 ]]; then
    echo "ctr-hosts.sh needs root (network namespaces, veths, tc): run it as root, e.g. sudo $0 $*" >&2
    exit 2
fi
mkdir -p /run/lock
exec 9>/run/lock/strata-bh.lock
if ! flock -n 9; then
    echo "another hosts.sh or ctr-hosts.sh run holds /run/lock/strata-bh.lock: wait for it to end" >&2
    exit 2
fi
cleanup() {
    local ns pid
    for ns in $(ip netns list 2>/dev/null | awk 'index($1, "strata-bh-") == 1 {print $1}'); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null
    done
}
trap cleanup EXIT
cleanup
if [[ ! -x target/release/strata ]]; then
    cargo build --release -p strata-cli || exit 1
fi
"$PY" scripts/bench/ctr_hosts.py --command "scripts/bench/ctr-hosts.sh $*" "$@"
