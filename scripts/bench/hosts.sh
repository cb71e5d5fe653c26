#!/usr/bin/env bash
# Training across emulated hosts at a link's speed: Strata's MultiWorkerMirrored (one replica per
# host) beside PyTorch DDP over gloo (default, fp16 compression hook, PowerSGD rank 4), with N
# hosts as network namespaces on one bridge and every host's link shaped with tc's tbf.
#
#   sudo scripts/bench/hosts.sh --quick                   # smoke: 2 hosts, 1gbit and unshaped, the MLP, 1 repeat
#   sudo scripts/bench/hosts.sh --hosts 2 --models mlp    # the 4.3M MLP at 2 hosts, 1gbit,10gbit,unshaped
#   sudo scripts/bench/hosts.sh                           # 2 and 4 hosts, 1gbit,10gbit,unshaped, mlp,cnn,transformer
#   scripts/bench/hosts.sh --help                         # every option
#
# Topology (every name starts with strata-bh-; nothing is added to the root namespace, so the
# traffic stays on this machine): a namespace strata-bh-br holds the bridge br0; host i is the
# namespace strata-bh-h<i> with eth0 = 10.213.77.(10+i)/24, whose veth peer h<i> is a port of
# br0. A link at RATE is shaped in both directions, on the egress of each end of its veth pair:
#   tc -n strata-bh-h<i> qdisc add dev eth0 root tbf rate RATE burst B latency 20ms
#   tc -n strata-bh-br   qdisc add dev h<i> root tbf rate RATE burst B latency 20ms
# with B = max(256 KiB, 4 ms at RATE): 64 KiB reached only 0.81 of 1 Gbit/s and 0.30 of
# 10 Gbit/s here; 256 KiB 0.96 and 0.75; 4 MiB 0.97 and 0.87 (one TCP stream, a loaded machine;
# an unshaped veth pair carried 10.5-14 Gbit/s, so 10gbit is near what this machine's CPUs move
# anyway). Each link's TCP goodput (one stream, 1.5 s) is measured and printed before its runs.
#
# Strata: each host runs `strata train --strategy multi-worker-mirrored --replicas 1` in its
# namespace (`ip netns exec`) with TF_CONFIG naming every host's address and port, --bind its
# address and one STRATA_CLUSTER_TOKEN; the rate is the chief's steady state from --out. When
# `strata train` has --compression, each of none,bf16,fp16,powersgd:4 runs (--compressions picks
# some); otherwise only none (the output says so). --zero-stages 0,1,2,3 adds Strata without
# compression at ZeRO stages 1 to 3 (none+zero1, none+zero2, none+zero3), alternated with the
# others. DDP (scripts/bench/ddp_hosts.py): one process per host, 1 thread,
# GLOO_SOCKET_IFNAME=eth0, the models of scripts/bench/peers/torch_bench.py, same global batch
# split over the hosts, AdamW lr 0.003 (PowerSGD: the model in one DDP bucket; see
# ddp_hosts.py). --peers picks the PyTorch configurations (default none,fp16,powersgd: DDP's
# hooks); fsdp2 adds FSDP2 (scripts/bench/peers/fsdp_peer.py: fully_shard per block, gloo, one
# process per host, 1 thread; the transformer only), to run beside --zero-stages 3, e.g.
#   sudo scripts/bench/hosts.sh --hosts 2 --links 1gbit,unshaped --models transformer \
#        --zero-stages 3 --compressions none --peers fsdp2
# Strata trains the digits models on the first 1,600 digits rows (--data), so
# that each epoch is 5 full global batches like the DDP side's. --repeats rounds (default 3),
# each running every link and, on each, every configuration once (A B C D A B C D); the tables
# (markdown, one per model) give the computed bytes per step per host, the median rate, the
# limit (the longer of the unshaped step time and the bytes over the link rate, each round's
# shaped run paired with its unshaped one), the share of it reached, and Strata's ratio to each
# DDP row; then every run's rate and Strata / DDP within each round. --save FILE keeps the
# figures as JSON; --render FILE prints their report again.
#
# PyTorch comes from the peers' virtual environment (PEERS_VENV, default
# ~/.cache/strata/peers-venv), installed there as scripts/bench/peers.sh does when missing
# (--no-install skips that; without torch the DDP rows are skipped). strata: target/release/strata,
# built with `cargo build --release -p strata-cli` when missing (or --strata PATH).
#
# Cleanup: every process started is killed (by process group, then whatever is left in the
# namespaces, by id) and the namespaces are deleted (their veths and the bridge with them) on
# any exit: the end, an error, Ctrl-C, SIGTERM. Leftovers of a killed run (SIGKILL) are removed
# when the next run starts. One run at a time (a lock in /run/lock).
set -uo pipefail

cd "$(dirname "$0")/../.."
HERE=scripts/bench
# shellcheck source=scripts/bench/peers/install-torch.sh
source scripts/bench/peers/install-torch.sh
SYS_PY=${PYTHON:-python3}
VENV=${PEERS_VENV:-$HOME/.cache/strata/peers-venv}
TORCH_SPEC=${PEERS_TORCH:-torch==2.15.*}
PREFIX=strata-bh-

install=1
args=()
for a in "$@"; do
    case "$a" in
        --no-install) install=0 ;;
        -h | --help) exec "$SYS_PY" "$HERE/hosts_bench.py" --help ;;
        --render | --render=*) exec "$SYS_PY" "$HERE/hosts_bench.py" "$@" ;; # a saved run's report: nothing to set up
        *) args+=("$a") ;;
    esac
done

# Root and the tools, then the arguments (a rate that does not parse: one line, exit 2);
# nothing is created before all pass.
if [[ $(id -u) -ne 0 ]]; then
    echo "hosts.sh needs root (network namespaces, veths, tc): run it as root, e.g. sudo $0 $*" >&2
    exit 2
fi
for tool in ip tc; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "hosts.sh needs \`$tool\`: install iproute2 (Debian: apt-get install iproute2), then run it again" >&2
        exit 2
    fi
done
if ! ip netns list >/dev/null 2>&1; then
    echo "hosts.sh cannot list network namespaces (\`ip netns list\` fails): it needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN" >&2
    exit 2
fi
if ! command -v "$SYS_PY" >/dev/null 2>&1; then
    echo "hosts.sh needs Python 3 ($SYS_PY not found): install python3 or set PYTHON=/path/to/python3" >&2
    exit 2
fi
"$SYS_PY" "$HERE/hosts_bench.py" --check-args "${args[@]}" || exit 2

mkdir -p /run/lock
exec 9>/run/lock/strata-bh.lock
if ! flock -n 9; then
    echo "another hosts.sh run holds /run/lock/strata-bh.lock: wait for it to end" >&2
    exit 2
fi

child=
cleanup() {
    if [[ -n "$child" ]] && kill -0 "$child" 2>/dev/null; then
        kill -TERM "$child" 2>/dev/null
        wait "$child" 2>/dev/null
    fi
    child=
    # Whatever the driver left (it was killed before its own cleanup): processes in our
    # namespaces, by id, then the namespaces.
    local ns pid
    for ns in $(ip netns list 2>/dev/null | awk -v p="$PREFIX" 'index($1, p) == 1 {print $1}'); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null
    done
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM HUP
trap cleanup EXIT
cleanup # a killed run's leftovers, and its logs (those of a failed run are kept: KEPT)
for d in "${TMPDIR:-/tmp}"/strata-bh-logs-*; do
    [[ -d "$d" && ! -e "$d/KEPT" ]] && rm -rf "$d"
done

# PyTorch, as scripts/bench/peers.sh installs it (torch only: the TensorFlow peers are not needed).
wants_ddp=1 wants_strata=1
for a in "${args[@]}"; do
    [[ "$a" == "--no-ddp" ]] && wants_ddp=0
    [[ "$a" == "--no-strata" ]] && wants_strata=0
done
PY="$VENV/bin/python"
if ((wants_ddp && install)) && ! { [[ -x "$PY" ]] && "$PY" -c 'import torch, numpy' 2>/dev/null; }; then
    install_torch_venv
    "$PY" -c 'import torch, numpy' 2>/dev/null ||
        echo "PyTorch cannot be installed or imported ($TORCH_SPEC): the DDP rows are skipped" >&2
fi

# strata
strata=target/release/strata
for ((i = 0; i < ${#args[@]}; i++)); do
    [[ "${args[$i]}" == "--strata" ]] && strata=${args[$((i + 1))]:-$strata}
    [[ "${args[$i]}" == --strata=* ]] && strata=${args[$i]#--strata=}
done
if ((wants_strata)) && [[ ! -x "$strata" && "$strata" == target/release/strata ]]; then
    echo "building strata: cargo build --release -p strata-cli" >&2
    cargo build --release -p strata-cli || echo "cargo build --release -p strata-cli failed: the Strata rows are skipped" >&2
fi

"$SYS_PY" "$HERE/hosts_bench.py" --python "$PY" --strata "$strata" --command "$0 $*" "${args[@]}" &
child=$!
wait "$child"
rc=$?
child=
exit $rc
