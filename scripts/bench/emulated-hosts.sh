# Sourced by the benchmarks that run on emulated hosts (slow-links.sh, ctr-hosts.sh): run
# `emulated_hosts NAME SCRIPT ARGS...` from the repository root. It refuses without root
# (network namespaces, veths, tc), takes the lock hosts.sh takes (one such run at a time:
# they share the strata-bh- namespaces), removes every strata-bh- namespace and its processes
# now and on any exit, builds target/release/strata if it is missing, and runs the Python
# SCRIPT (scripts/bench/SCRIPT) with ARGS and the command line it was started with.
emulated_hosts() {
    local name=$1 script=$2
    shift 2
    if [[ $(id -u) -ne 0 ]]; then
        echo "$name needs root (network namespaces, veths, tc): run it as root, e.g. sudo scripts/bench/$name $*" >&2
        exit 2
    fi
    mkdir -p /run/lock
    exec 9>/run/lock/strata-bh.lock
    if ! flock -n 9; then
        echo "another hosts.sh, slow-links.sh or ctr-hosts.sh run holds /run/lock/strata-bh.lock: wait for it to end" >&2
        exit 2
    fi
    trap emulated_hosts_cleanup EXIT
    emulated_hosts_cleanup
    if [[ ! -x target/release/strata ]]; then
        cargo build --release -p strata-cli || exit 1
    fi
    "${PYTHON:-python3}" "scripts/bench/$script" --command "scripts/bench/$name $*" "$@"
}

emulated_hosts_cleanup() {
    local ns pid
    for ns in $(ip netns list 2>/dev/null | awk 'index($1, "strata-bh-") == 1 {print $1}'); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null
    done
}
