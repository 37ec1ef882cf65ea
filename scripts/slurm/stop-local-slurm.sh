#!/usr/bin/env bash
# Stop the daemons scripts/slurm/start-local-slurm.sh started: exactly the processes
# named by its pid files (and still running the command the file is named after), never
# anything found by name. Leaves /etc/slurm/slurm.conf and the state directory in place.
set -uo pipefail

STATE=${FORGE_SLURM_STATE:-/tmp/forgerl-slurm}

# stop NAME: SIGTERM the recorded pid, wait up to 10 s, then SIGKILL.
stop() {
    local name=$1 pidfile=$STATE/$1.pid pid
    [[ -s $pidfile ]] || return 0
    pid=$(<"$pidfile")
    if [[ -r /proc/$pid/comm && $(</proc/$pid/comm) == "$name" ]]; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do [[ -e /proc/$pid ]] || break; sleep 0.1; done
        if [[ -e /proc/$pid ]]; then
            kill -KILL "$pid" 2>/dev/null
        fi
        echo "stop-local-slurm: stopped $name (pid $pid)"
    fi
    rm -f "$pidfile"
}

# slurmd first (it ends the job steps it runs), then the controller, then munge.
stop slurmd
stop slurmctld
stop munged
