# Sourced by tw-job.sbatch and tw-servers.sh: the server nodes of this job (its het-job component 0),
# where its secrets live, and TENSORWIRE_SERVERS. Slot i has its primary on server node i (port
# TW_PORT) and, with two or more server nodes, its backup on node i+1 (port TW_PORT+1), so no slot
# keeps both copies on one node.
: "${TW_PORT:=7070}"
: "${TW_SECRETS:=$HOME/.tensorwire/$SLURM_JOB_ID}"  # a directory on the shared file system
mapfile -t TW_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0")

tw_servers() {
    local n=${#TW_NODES[@]} i slot slots=()
    for i in "${!TW_NODES[@]}"; do
        slot="tcp://${TW_NODES[$i]}:$TW_PORT"
        if ((n > 1)); then slot+="|tcp://${TW_NODES[$(((i + 1) % n))]}:$((TW_PORT + 1))"; fi
        slots+=("$slot")
    done
    (IFS=,; echo "${slots[*]}")
}
