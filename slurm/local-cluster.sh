#!/bin/bash
# A throw-away Slurm cluster on localhost, for mpirl's tests and for trying the job scripts:
# munged, slurmctld and one slurmd per node, all on this machine: the first node is named after
# it (hostname -s), the others (n2, n3, ...) are emulated. Each has its own slurm.conf, key and
# state under one directory. Two nodes, because Slurm's backfill scheduler starts a
# heterogeneous job only when each component can have a node of its own.
# Nothing under /etc is changed; point Slurm's commands at it with
#     eval "$(slurm/local-cluster.sh env)"      # export SLURM_CONF=...
#
#   slurm/local-cluster.sh install   apt-get install slurmctld slurmd slurm-client munge
#                                    libpmix-dev, those missing
#   slurm/local-cluster.sh start     write the config and start the daemons (waits until idle)
#   slurm/local-cluster.sh stop      cancel every job, stop the daemons
#   slurm/local-cluster.sh status    sinfo and squeue
#   slurm/local-cluster.sh env       the export line for SLURM_CONF
#
# Settings (environment): MPIRL_SLURM_DIR (default /tmp/mpirl-slurm), MPIRL_SLURM_NODES (default
# 2), MPIRL_SLURM_CPUS (CPUs each node advertises, default 4: more than a small machine has, so
# tests can start 3-4 ranks per node; SlurmdParameters=config_overrides lets slurmd accept it),
# MPIRL_SLURM_PORT (slurmctld's port, default 6817; node i listens on PORT+i).
#
# Containers: there are no cgroups to rely on, so processes are tracked by parentage
# (proctrack/linuxproc) and tasks are not bound (task/none). A requeued job may start again only
# after the job credential expires (AuthInfo cred_expire, 120 s by default): 10 s here.
# srun --mpi=pmix: Debian's Slurm plugin loads libpmix.so, which only libpmix-dev provides
# (libpmix2 has libpmix.so.2), and slurmd must start after it is installed. On an emulated node
# (a name that is not the host's), Open MPI 5's wheel fails MPI_Init in every task after the
# second (it reads a cpuset from Slurm's PMIx 4 server and aborts); on the first node any number
# works. So the default partition (debug) holds the first node only; partition "all" has them all.
set -euo pipefail

DIR=${MPIRL_SLURM_DIR:-/tmp/mpirl-slurm}
NODES=${MPIRL_SLURM_NODES:-2}
CPUS=${MPIRL_SLURM_CPUS:-4}
PORT=${MPIRL_SLURM_PORT:-6817}
CONF=$DIR/slurm.conf

say() { echo "local-cluster: $*" >&2; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_names() { hostname -s; [ "$NODES" -lt 2 ] || seq -f "n%g" 2 "$NODES"; }

install() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    if command -v dpkg-query >/dev/null; then
        dpkg-query -W -f='${Status}' libpmix-dev 2>/dev/null | grep -q "ok installed" ||
            missing+=(libpmix-dev)
    fi
    if [ ${#missing[@]} -eq 0 ]; then
        say "installed: $(slurmd -V), $(munged -V 2>&1 | head -n1)"
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        say "cannot install ${missing[*]}: no apt-get on this machine"; return 1
    fi
    if [ "$(id -u)" != 0 ]; then
        say "cannot install ${missing[*]}: apt-get needs root"; return 1
    fi
    say "installing ${missing[*]} with apt-get"
    # A fresh container has no package lists; if the update fails, install says why.
    apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

write_config() {
    local host memory node i=1
    host=$(hostname -s)
    # slurmd -C prints this machine's memory; the nodes share it, less 1 GiB for the rest.
    memory=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    memory=${memory:-2048}
    memory=$(( (memory > 2048 ? memory - 1024 : memory) / NODES ))
    mkdir -p "$DIR"/{munge,state,log}
    chmod 700 "$DIR/munge"
    for node in $(node_names); do mkdir -p "$DIR/spool/$node" "$DIR/tmp/$node"; done
    cat >"$CONF" <<CONF
# Written by mpirl's slurm/local-cluster.sh: a test cluster of $NODES nodes, all on $host.
ClusterName=mpirl-test
SlurmctldHost=$host
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$DIR/state
# Per node (%n): several slurmd share this machine. srun --mpi=pmix names its client directory
# under TmpFS by job and step only, so each node needs a TmpFS of its own.
SlurmdSpoolDir=$DIR/spool/%n
TmpFS=$DIR/tmp/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in containers: track processes by parentage, do not bind tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
JobRequeue=1
ReturnToService=2
# Short waits: a test cluster should react in seconds.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=3600
SlurmctldTimeout=60
SlurmdTimeout=60
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
CONF
    for node in $(node_names); do
        echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + i))" \
            "CPUs=$CPUS RealMemory=$memory State=UNKNOWN" >>"$CONF"
        i=$((i + 1))
    done
    # The default partition holds the first node only (see the note on emulated nodes above);
    # "all" holds every node, for jobs that need several.
    echo "PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    echo "PartitionName=all Nodes=ALL MaxTime=INFINITE State=UP" >>"$CONF"
}

start() {
    local tool node states="" up=0
    for tool in munged slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || { say "$tool is not installed (run: $0 install)"; return 1; }
    done
    write_config
    if ! alive "$DIR/munged.pid"; then
        [ -f "$DIR/munge/munge.key" ] || {
            dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
            chmod 400 "$DIR/munge/munge.key"
        }
        munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
            --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" \
            --seed-file="$DIR/munge/munged.seed"
    fi
    export SLURM_CONF=$CONF
    alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF"
    for node in $(node_names); do
        alive "$DIR/slurmd-$node.pid" || slurmd -f "$CONF" -N "$node"
    done
    for _ in $(seq 1 120); do
        # A node in two partitions is listed twice.
        states=$(sinfo -h -N -o "%N %T" 2>/dev/null | sort -u || true)
        up=$(echo "$states" | grep -cE " (idle|mixed|allocated)$" || true)
        [ "$up" = "$NODES" ] && break
        if echo "$states" | grep -qE "drain|down"; then
            scontrol update nodename="$(node_names | paste -sd,)" state=resume >/dev/null 2>&1 ||
                true
        fi
        sleep 0.5
    done
    if [ "$up" != "$NODES" ]; then
        say "the nodes did not come up (${states:-no answer from slurmctld}); logs in $DIR/log"
        tail -n 5 "$DIR"/log/*.log >&2 || true
        return 1
    fi
    say "up: $(sinfo -V), nodes $(node_names | paste -sd,) on this machine; SLURM_CONF=$CONF"
}

stop() {
    local jobs pidfile pid
    export SLURM_CONF=$CONF
    if alive "$DIR/slurmctld.pid"; then
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 1 40); do
                [ -z "$(squeue -h -o %i 2>/dev/null || true)" ] && break
                sleep 0.25
            done
        fi
    fi
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
    say "stopped"
}

status() {
    export SLURM_CONF=$CONF
    alive "$DIR/slurmctld.pid" || { say "not running"; return 1; }
    sinfo
    squeue
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
