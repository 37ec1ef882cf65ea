#!/usr/bin/env bash
# Start a single-node Slurm on this machine (munge, slurmctld, slurmd as background
# processes; there is no systemd here) for forgerl's Slurm integration tests.
#
# Idempotent: installs the packages only when missing, writes /etc/slurm/slurm.conf
# (refusing to replace one it did not write), starts only the daemons that are not
# already running from a previous call, waits until `sinfo` shows the node idle and
# prints how long that took. Stop with scripts/slurm/stop-local-slurm.sh, which ends
# exactly the daemons recorded here by pid file.
#
# Environment:
#   FORGE_SLURM_STATE  state, spool, logs and pid files (default /tmp/forgerl-slurm)
#   FORGE_SLURM_CPUS   CPUs the node advertises (default: this machine's, nproc)
#   FORGE_SLURM_WAIT   seconds to wait for the node to become idle (default 60)
set -euo pipefail

STATE=${FORGE_SLURM_STATE:-/tmp/forgerl-slurm}
CPUS=${FORGE_SLURM_CPUS:-$(nproc)}
WAIT=${FORGE_SLURM_WAIT:-60}
CONF=/etc/slurm/slurm.conf
MARKER="# written by forgerl scripts/slurm/start-local-slurm.sh"
START=$(date +%s.%N)

if [[ $(id -u) -ne 0 ]]; then
    echo "start-local-slurm: must run as root (it installs packages and writes $CONF)" >&2
    exit 2
fi

need_install=()
for bin in munged slurmctld slurmd sbatch; do
    command -v "$bin" >/dev/null || need_install=(slurm-wlm munge)
done
if ((${#need_install[@]})); then
    echo "start-local-slurm: installing ${need_install[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${need_install[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null && apt-get install -y -qq "${need_install[@]}" >/dev/null; }
fi

mkdir -p "$STATE"/{ctld,spool,log} /etc/slurm /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    # Debian's postinst normally creates the key; make one if a minimal image skipped it.
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi

HOST=$(hostname -s)
# MB the node advertises: slurmd refuses a node configured with more than it has, so
# stay a little under what the kernel reports.
MEM_MB=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)

NEW_CONF=$(cat <<CONF
$MARKER
ClusterName=forgerl
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Requeued jobs wait cred_expire seconds before they start again (default 120).
AuthInfo=cred_expire=10
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.slurm.pid
SlurmdPidFile=$STATE/slurmd.slurm.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
# No slurmdbd here: finished jobs go to a text file that \`sacct -c\` reads.
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=300
KillWait=5
InactiveLimit=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
)

if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    echo "start-local-slurm: $CONF exists and was not written by this script; not replacing it" >&2
    exit 2
fi
conf_changed=0
if [[ ! -e $CONF ]] || [[ "$(cat "$CONF")" != "$NEW_CONF" ]]; then
    printf '%s\n' "$NEW_CONF" > "$CONF"
    conf_changed=1
fi

# running NAME: true when the pid file names a live process whose command is NAME.
running() {
    local pidfile=$STATE/$1.pid pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/comm && $(</proc/$pid/comm) == "$1" ]]
}

# stale NAME: true when the running NAME's working directory was deleted (it was started
# from a checkout since removed); job steps it spawns would inherit that directory and
# slurmstepd prints an error into every job's output.
stale() {
    local pid
    pid=$(<"$STATE/$1.pid")
    [[ $(readlink "/proc/$pid/cwd" 2>/dev/null) == *" (deleted)" ]]
}

# start NAME CMD...: start CMD in its own session from /, record its pid, unless already up.
start() {
    local name=$1; shift
    if running "$name" && stale "$name"; then
        local pid
        pid=$(<"$STATE/$name.pid")
        echo "start-local-slurm: restarting $name (pid $pid): its working directory was deleted"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do [[ -e /proc/$pid ]] || break; sleep 0.1; done
    fi
    if running "$name"; then
        echo "start-local-slurm: $name already running (pid $(<"$STATE/$name.pid"))"
        return
    fi
    ( cd / && exec setsid "$@" >"$STATE/log/$name.out" 2>&1 < /dev/null ) &
    echo $! > "$STATE/$name.pid"
}

start munged setpriv --reuid=munge --regid=munge --init-groups munged --foreground
for _ in $(seq 50); do [[ -S /run/munge/munge.socket.2 ]] && break; sleep 0.1; done
[[ -S /run/munge/munge.socket.2 ]] || { echo "start-local-slurm: munged did not start; see $STATE/log/munged.out" >&2; exit 1; }

if ((conf_changed)) && running slurmctld; then
    scontrol reconfigure || true
fi
start slurmctld slurmctld -D -i
start slurmd slurmd -D

deadline=$(( $(date +%s) + WAIT ))
state=""
while (( $(date +%s) < deadline )); do
    state=$(sinfo -h -N -n "$HOST" -o %t 2>/dev/null | head -1 || true)
    if [[ $state == idle* || $state == mix* || $state == alloc* ]]; then
        elapsed=$(awk -v s="$START" -v e="$(date +%s.%N)" 'BEGIN {printf "%.1f", e - s}')
        echo "start-local-slurm: node $HOST $state after ${elapsed}s (state in $STATE)"
        exit 0
    fi
    # A node left down/drained by an earlier run comes back when told to.
    if [[ $state == down* || $state == drain* ]]; then
        scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.5
done
echo "start-local-slurm: node $HOST not idle after ${WAIT}s (state '${state:-no answer}'); see $STATE/log/" >&2
exit 1
