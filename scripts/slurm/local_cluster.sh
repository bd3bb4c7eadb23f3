#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for trying and testing the sbatch scripts of this folder.
#
#   scripts/slurm/local_cluster.sh start  [DIR]   # install slurm + munge if missing, start munged,
#                                                 # slurmctld and slurmd; wait for the node
#   scripts/slurm/local_cluster.sh status [DIR]   # exit 0 when all three run and the node is usable
#   scripts/slurm/local_cluster.sh stop   [DIR]   # stop them (jobs still running are killed)
#   scripts/slurm/local_cluster.sh env    [DIR]   # the line that points sbatch & co. at the cluster
#   eval "$(scripts/slurm/local_cluster.sh env)" && sbatch job.sbatch
#
# DIR (default $MEGATRON_EXT_SLURM_DIR, else $TMPDIR/megatron_ext-slurm, TMPDIR defaulting to /tmp) holds everything: slurm.conf,
# the munge key and socket, state, spool, logs and the job-completion log. Nothing under /etc is
# read or written, so a system SLURM elsewhere on the machine is left alone. Every daemon binds
# 127.0.0.1 only. The daemons run as the calling user: root (slurmd starts job steps as the
# submitting user); installing the packages needs root or password-less sudo.
#
# The node is `localhost` with the machine's CPUs and as many GRES "gpu" as CPUs, their device
# files links to /dev/null: the sbatch templates ask for --gpus-per-node, which a CPU run needs
# granted (SLURM sets CUDA_VISIBLE_DEVICES, which a CPU-only torch ignores). Containers
# often lack systemd and a writable cgroup tree, so the daemons are started directly and the
# plugins are the simplest ones: proctrack/linuxproc (a step's processes are the descendants of
# its slurmstepd; signals reach all of them, as with proctrack/cgroup), task/none, no cgroups.
# Accounting: no slurmdbd (a database and a daemon more). A job's final state is read with
# `scontrol show job`, which keeps finished jobs for MinJobAge (10 minutes here), and every job
# that ends leaves a line in DIR/jobcomp.log (jobcomp/filetxt) that stays after that.
#
# Environment: SLURM_LOCAL_CTLD_PORT (6817) and SLURM_LOCAL_SLURMD_PORT (6818) choose the ports.
# Exit codes: 0 done; 1 status: not running; 2 usage; 3 the packages cannot be installed;
# 4 a daemon did not start (its log is named).
set -euo pipefail

COMMAND=${1:-}
DIR=${2:-${MEGATRON_EXT_SLURM_DIR:-${TMPDIR:-/tmp}/megatron_ext-slurm}}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
PACKAGES=(slurmctld slurmd slurm-client munge)
NODE=localhost
# The daemons find gres.conf next to the slurm.conf this names, and the clients find the cluster.
export SLURM_CONF=$DIR/slurm.conf

fail() {  # one line, then exit with the given code
    echo "local_cluster: $2" >&2
    exit "$1"
}

as_root() {
    if [[ $(id -u) == 0 ]]; then "$@"; else sudo -n "$@"; fi
}

have_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v munged >/dev/null && command -v sbatch >/dev/null
}

install_packages() {
    have_packages && return 0
    command -v apt-get >/dev/null || fail 3 "slurm/munge are not installed and there is no apt-get"
    echo "local_cluster: installing ${PACKAGES[*]}" >&2
    local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends)
    if ! as_root "${install[@]}" "${PACKAGES[@]}" >"$DIR/apt.log" 2>&1; then
        as_root apt-get update -qq >>"$DIR/apt.log" 2>&1 &&
            as_root "${install[@]}" "${PACKAGES[@]}" >>"$DIR/apt.log" 2>&1 ||
            fail 3 "installing ${PACKAGES[*]} failed: see $DIR/apt.log"
    fi
    have_packages || fail 3 "installed ${PACKAGES[*]}, but slurmctld/slurmd/munged/sbatch are missing"
}

pid_alive() {  # pid_alive PIDFILE
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

write_config() {
    local cpus user
    # nproc would answer OMP_NUM_THREADS when it is set (the test suite sets 1): the CPUs the
    # processes here may run on, which is what the node offers its jobs.
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    user=$(id -un)
    cat >"$DIR/slurm.conf.new" <<EOF
# Written by scripts/slurm/local_cluster.sh: a one-node cluster on localhost.
ClusterName=megatron-ext-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
# Bind the daemons' and srun's sockets to the node's address (127.0.0.1), not to every interface.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
# Look at pending jobs every 2 s (default 60 s): a requeued or released job starts at once.
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Finished jobs stay visible to \`scontrol show job\` this long (seconds).
MinJobAge=600
# Seconds between a job's SIGTERM (scancel, requeue, time limit) and its SIGKILL.
KillWait=60
# A requeued job may start again at once.
JobRequeue=1
ReturnToService=2
# The node's CPU count comes from this file even where slurmd counts threads differently.
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus Gres=gpu:$cpus State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    # SLURM drops a gpu GRES without device files; links to /dev/null stand in for the devices.
    local gpu
    for ((gpu = 0; gpu < cpus; gpu++)); do ln -sfn /dev/null "$DIR/fake-gpu$gpu"; done
    echo "Name=gpu File=$DIR/fake-gpu[0-$((cpus - 1))]" >"$DIR/gres.conf.new"
    mv "$DIR/slurm.conf.new" "$DIR/slurm.conf"
    mv "$DIR/gres.conf.new" "$DIR/gres.conf"
}

start_munged() {
    pid_alive "$DIR/munge/munged.pid" && return 0
    if [[ ! -s $DIR/munge/munge.key ]]; then
        (umask 077 && dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none)
    fi
    chmod 400 "$DIR/munge/munge.key"
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" ||
        fail 4 "munged did not start: see $DIR/log/munged.log"
}

start_slurm_daemons() {
    if ! pid_alive "$DIR/slurmctld.pid"; then
        # -c: forget jobs of an earlier cluster in this folder; -i: ignore unreadable old state.
        slurmctld -f "$DIR/slurm.conf" -c -i || fail 4 "slurmctld did not start: see $DIR/log/slurmctld.log"
    fi
    if ! pid_alive "$DIR/slurmd.pid"; then
        slurmd -f "$DIR/slurm.conf" -N "$NODE" || fail 4 "slurmd did not start: see $DIR/log/slurmd.log"
    fi
}

node_state() {
    pid_alive "$DIR/slurmctld.pid" || return 0
    sinfo -h -n "$NODE" -o %T 2>/dev/null || true
}

wait_for_node() {
    local state
    for _ in $(seq 60); do
        state=$(node_state)
        case $state in
            idle*|mixed*|allocated*|completing*) return 0 ;;
            down*|drain*|fail*)
                scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    fail 4 "the node did not come up (state '${state:-none}'): see $DIR/log/slurmctld.log and slurmd.log"
}

cmd_start() {
    mkdir -p "$DIR"
    install_packages
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/munge"
    chmod 755 "$DIR"
    chmod 700 "$DIR/munge" "$DIR/state" "$DIR/spool"
    if cmd_status >/dev/null 2>&1; then
        echo "local_cluster: already running ($DIR/slurm.conf)"
        return 0
    fi
    pid_alive "$DIR/slurmctld.pid" || write_config
    start_munged
    start_slurm_daemons
    wait_for_node
    echo "local_cluster: running; $(cmd_env)"
}

stop_pidfile() {  # stop_pidfile PIDFILE: TERM, then KILL after 10 s
    pid_alive "$1" || return 0
    local pid
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

cmd_stop() {
    if [[ -f $DIR/slurm.conf ]] && pid_alive "$DIR/slurmctld.pid"; then
        scancel --quiet --full --user="$(id -un)" 2>/dev/null || true
    fi
    stop_pidfile "$DIR/slurmd.pid"
    stop_pidfile "$DIR/slurmctld.pid"
    stop_pidfile "$DIR/munge/munged.pid"
    echo "local_cluster: stopped"
}

cmd_status() {
    local ok=0 name
    for name in munge/munged slurmctld slurmd; do
        if pid_alive "$DIR/$name.pid"; then
            echo "${name#munge/}: running (pid $(cat "$DIR/$name.pid"))"
        else
            echo "${name#munge/}: stopped"
            ok=1
        fi
    done
    local state
    state=$(node_state)
    echo "node $NODE: ${state:-unknown}"
    case $state in idle*|mixed*|allocated*|completing*) ;; *) ok=1 ;; esac
    return $ok
}

cmd_env() {
    echo "export SLURM_CONF=$DIR/slurm.conf"
}

case $COMMAND in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *) echo "usage: $0 start|stop|status|env [DIR]" >&2; exit 2 ;;
esac
