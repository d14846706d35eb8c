# Sourced by tw-job.sbatch and tw-servers.sh: the server nodes of this job (its het-job component 0),
# where its secrets live, and TENSORWIRE_SERVERS. Slot i has its primary on server node i (port
# TW_PORT) and, with two or more server nodes, its backup on node i+1 (port TW_PORT+1), so no slot
# keeps both copies on one node.
: "${TW_PORT:=7070}"
: "${TW_SECRETS:=$HOME/.tensorwire/$SLURM_JOB_ID}"  # a directory on the shared file system
mapfile -t TW_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0")

# Optional: etcd decides each slot's primary (a lease per slot) instead of a standby taking over
# after its primary's silence. Either TW_ETCD=1: one etcd for this job on the first server node
# (tw-servers.sh starts it there, port TW_ETCD_PORT and the next, its data node-local; no users:
# for a cluster network you trust, as the recipe's tcp://), or TW_COORDINATOR=etcd[s]://HOST:PORT
# [,HOST:PORT...]/PREFIX: an etcd cluster you run, with TW_COORDINATOR_ARGS its flags (split on
# spaces), e.g. "--coordinator-user tw-server --coordinator-password-file $HOME/.tensorwire/etcd".
: "${TW_ETCD:=0}"
: "${TW_ETCD_PORT:=2379}"
: "${TW_LEASE_TTL:=3}"
if [[ $TW_ETCD == 1 ]]; then
    tw_own_etcd="etcd://${TW_NODES[0]}:$TW_ETCD_PORT/tensorwire"
    if [[ ${TW_COORDINATOR:-$tw_own_etcd} != "$tw_own_etcd" ]]; then
        echo "tw-env.sh: set TW_ETCD=1 (an etcd of the job's own) or TW_COORDINATOR, not both" >&2
        return 2
    fi
    TW_COORDINATOR=$tw_own_etcd
fi

tw_servers() {
    local n=${#TW_NODES[@]} i slot slots=()
    for i in "${!TW_NODES[@]}"; do
        slot="tcp://${TW_NODES[$i]}:$TW_PORT"
        if ((n > 1)); then slot+="|tcp://${TW_NODES[$(((i + 1) % n))]}:$((TW_PORT + 1))"; fi
        slots+=("$slot")
    done
    (IFS=,; echo "${slots[*]}")
}
