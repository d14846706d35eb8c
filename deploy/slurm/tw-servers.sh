#!/bin/bash
# One server node of the job (run by `srun --het-group=0`): the primary of this node's slot and,
# with two or more server nodes, the backup of the previous node's slot. Exits when either exits.
set -euo pipefail
source "$(dirname "$0")/tw-env.sh"
node=${SLURMD_NODENAME:-$(hostname -s)}
n=${#TW_NODES[@]}
for i in "${!TW_NODES[@]}"; do [[ ${TW_NODES[$i]} == "$node" ]] && break; done
[[ ${TW_NODES[$i]} == "$node" ]] || { echo "node $node is not a server node: ${TW_NODES[*]}" >&2; exit 2; }
checkpoints=${TW_CHECKPOINTS:-/tmp/tensorwire-$SLURM_JOB_ID}  # node-local: each server keeps its own
common=(--capacity "${TW_CAPACITY:-64GiB}" --token-file "$TW_SECRETS/token")
if ((n == 1)); then
    exec tensorwire ps serve --listen "tcp://$node:$TW_PORT" "${common[@]}" --checkpoint-dir "$checkpoints/slot$i"
fi
prev=$(((i + n - 1) % n)) next=$(((i + 1) % n))
# The backup first (its primary, on the previous node, replicates to it), then this node's primary.
tensorwire ps serve --listen "tcp://$node:$((TW_PORT + 1))" --standby "${common[@]}" \
    --checkpoint-dir "$checkpoints/slot$prev-backup" \
    --peer-token-file "$TW_SECRETS/peer" --backup "tcp://${TW_NODES[$prev]}:$TW_PORT" &
tensorwire ps serve --listen "tcp://$node:$TW_PORT" "${common[@]}" --checkpoint-dir "$checkpoints/slot$i" \
    --peer-token-file "$TW_SECRETS/peer" --backup "tcp://${TW_NODES[$next]}:$((TW_PORT + 1))" &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
wait -n
