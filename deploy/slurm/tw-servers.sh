#!/bin/bash
# One server node of the job (run by `srun --het-group=0`): the primary of this node's slot and,
# with two or more server nodes, the backup of the previous node's slot; with TW_ETCD=1 on the
# first server node, the job's etcd too. Exits when either server exits (not when etcd does: the
# servers outlive a lost etcd as long as each primary reaches its backups).
set -euo pipefail
source "$(dirname "$0")/tw-env.sh"
node=${SLURMD_NODENAME:-$(hostname -s)}
n=${#TW_NODES[@]}
for i in "${!TW_NODES[@]}"; do [[ ${TW_NODES[$i]} == "$node" ]] && break; done
[[ ${TW_NODES[$i]} == "$node" ]] || { echo "node $node is not a server node: ${TW_NODES[*]}" >&2; exit 2; }
checkpoints=${TW_CHECKPOINTS:-/tmp/tensorwire-$SLURM_JOB_ID}  # node-local: each server keeps its own
common=(--capacity "${TW_CAPACITY:-64GiB}" --token-file "$TW_SECRETS/token")
if ((n == 1)); then
    [[ -z ${TW_COORDINATOR:-} ]] || echo "tw-servers.sh: one server node, no backups: no etcd used" >&2
    exec tensorwire ps serve --listen "tcp://$node:$TW_PORT" "${common[@]}" --checkpoint-dir "$checkpoints/slot$i"
fi
trap 'kill $(jobs -p) 2>/dev/null' EXIT

# etcd (TW_ETCD=1) on the first server node, listening on that node's address only (etcd binds to
# an IP, not a name); every node waits for it before its servers start.
if [[ $TW_ETCD == 1 ]]; then
    etcd_host=${TW_NODES[0]} peer=$((TW_ETCD_PORT + 1))
    if ((i == 0)); then
        ip=$(getent ahostsv4 "$node" | awk 'NR == 1 {print $1}')
        [[ -n $ip ]] || { echo "tw-servers.sh: no IPv4 address for $node (etcd binds to one)" >&2; exit 3; }
        mkdir -p -m 700 "$checkpoints"
        etcd --name tw --data-dir "$checkpoints/etcd" \
            --listen-client-urls "http://$ip:$TW_ETCD_PORT" --advertise-client-urls "http://$node:$TW_ETCD_PORT" \
            --listen-peer-urls "http://$ip:$peer" --initial-advertise-peer-urls "http://$node:$peer" \
            --initial-cluster "tw=http://$node:$peer" >"$checkpoints/etcd.log" 2>&1 &
    fi
    deadline=$((SECONDS + ${TW_ETCD_WAIT:-60}))
    until (exec 3<>"/dev/tcp/$etcd_host/$TW_ETCD_PORT") 2>/dev/null; do
        ((SECONDS < deadline)) || { echo "tw-servers.sh: no etcd at $etcd_host:$TW_ETCD_PORT" >&2; exit 3; }
        sleep 0.2
    done
fi

prev=$(((i + n - 1) % n)) next=$(((i + 1) % n))
backup="tcp://$node:$((TW_PORT + 1))" primary="tcp://$node:$TW_PORT"
# With a coordinator: every replica names its slot and the URL the others reach it at. --standby
# then only lets the primary campaign first, so each slot starts with its primary on node i.
as_backup=() as_primary=()
if [[ -n ${TW_COORDINATOR:-} ]]; then
    read -ra extra <<<"${TW_COORDINATOR_ARGS:-}"
    shared=(--coordinator "$TW_COORDINATOR" --lease-ttl "$TW_LEASE_TTL" ${extra[@]+"${extra[@]}"})
    as_backup=("${shared[@]}" --slot "slot$prev" --advertise "$backup")
    as_primary=("${shared[@]}" --slot "slot$i" --advertise "$primary")
fi
# The backup first (its primary, on the previous node, replicates to it), then this node's primary.
tensorwire ps serve --listen "$backup" --standby "${common[@]}" \
    --checkpoint-dir "$checkpoints/slot$prev-backup" \
    --peer-token-file "$TW_SECRETS/peer" --backup "tcp://${TW_NODES[$prev]}:$TW_PORT" \
    ${as_backup[@]+"${as_backup[@]}"} &
servers=($!)
tensorwire ps serve --listen "$primary" "${common[@]}" --checkpoint-dir "$checkpoints/slot$i" \
    --peer-token-file "$TW_SECRETS/peer" --backup "tcp://${TW_NODES[$next]}:$((TW_PORT + 1))" \
    ${as_primary[@]+"${as_primary[@]}"} &
servers+=($!)
status=0
while kill -0 "${servers[0]}" 2>/dev/null && kill -0 "${servers[1]}" 2>/dev/null; do
    status=0
    wait -n || status=$?
done
exit "$status"
