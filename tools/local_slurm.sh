#!/usr/bin/env bash
# A real SLURM of one node on this machine, to run the README's job script as a cluster would:
# installs Debian's slurm-wlm and munge where they are missing (apt-get), writes a one-node
# configuration into a folder of its own (nothing in /etc is changed), starts munged, slurmctld
# and slurmd there, and stops them and removes the folder again.
#   bash tools/local_slurm.sh start DIR      # then: export SLURM_CONF=DIR/slurm.conf
#   bash tools/local_slurm.sh stop DIR       # cancels the jobs, stops the daemons, removes DIR
#   bash tools/local_slurm.sh job CPUS       # the README's job script for one node of CPUS
#                                            # tasks: --smoke, no GPUs (tests/test_slurm.py)
# Needs root (the daemons run as root, as slurm.conf's SlurmUser says) and Debian's package
# sources. Exit codes: 0 done; 5 this machine cannot run SLURM's daemons (one line says why).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cannot() { echo "local_slurm.sh: cannot run SLURM here: $*" >&2; exit 5; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  [ "$(id -u)" = 0 ] || cannot "installing slurm-wlm and munge needs root"
  command -v apt-get >/dev/null || cannot "no apt-get to install slurm-wlm and munge with"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q slurm-wlm munge >/dev/null 2>&1; } ||
    cannot "apt-get could not install slurm-wlm and munge"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start() {
  local dir=$1
  [ "$(id -u)" = 0 ] || cannot "slurmd and slurmctld run as root here (SlurmUser=root)"
  install
  mkdir -p "$dir"/{state,spool,log,run,munge}
  dir=$(cd "$dir" && pwd)
  chown munge:munge "$dir/munge" 2>/dev/null || true
  [ -f /etc/munge/munge.key ] || cannot "munge has no key (/etc/munge/munge.key)"
  local host cpus
  host=$(hostname)
  cpus=$(nproc)
  cat > "$dir/slurm.conf" <<EOF
# one node, this machine: $cpus CPUs, no GPUs, no cgroups (a container has none to give); a requeued job starts
# again by itself once its old credential has expired (cred_expire, 120 s by default), at the scheduler's next pass
# (sched_interval, 60 s by default)
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobRequeue=1
KillWait=30
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  munged --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" -f 2>"$dir/log/start.err" ||
    cannot "munged did not start: $(tail -n 1 "$dir/log/start.err")"
  slurmctld 2>>"$dir/log/start.err" || cannot "slurmctld did not start: $(tail -n 1 "$dir/log/start.err")"
  slurmd 2>>"$dir/log/start.err" || cannot "slurmd did not start: $(tail -n 1 "$dir/log/start.err")"
  for _ in $(seq 1 60); do
    [ "$(sinfo -h -o %T 2>/dev/null)" = idle ] && { echo "export SLURM_CONF=$dir/slurm.conf"; return; }
    sleep 0.5
  done
  cannot "the node did not come up: $(tail -n 2 "$dir/log/slurmctld.log" | tr '\n' ' ')"
}

stop() {
  local dir=$1
  [ -d "$dir" ] || return 0
  dir=$(cd "$dir" && pwd)
  export SLURM_CONF=$dir/slurm.conf
  scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
  for pid in "$dir/run/slurmd.pid" "$dir/run/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  for pid in "$dir/run/slurmd.pid" "$dir/run/slurmctld.pid" "$dir/munge/munged.pid"; do
    for _ in $(seq 1 50); do [ -f "$pid" ] && kill -0 "$(cat "$pid")" 2>/dev/null || break; sleep 0.1; done
  done
  rm -rf "$dir"
}

# The README's job script (the block under "With SLURM"), as one node with CPUS tasks runs it:
# its node and task counts set to 1 and CPUS, no GPUs asked for, and --smoke for the CPU.
job() {
  local cpus=$1
  sed -n '/^#!\/bin\/bash$/,/^```$/p' "$root/README.md" | sed '$d' | sed \
    -e "s/^#SBATCH --nodes=.*/#SBATCH --nodes=1/" \
    -e "s/^#SBATCH --ntasks-per-node=.*/#SBATCH --ntasks-per-node=$cpus/" \
    -e "/^#SBATCH --gpus-per-node/d" \
    -e "s/--devices [0-9]* --num-nodes [0-9]*/--devices $cpus --num-nodes 1 --smoke/"
}

case "${1:-}" in
  start) start "${2:?start DIR}" ;;
  stop) stop "${2:?stop DIR}" ;;
  job) job "${2:?job CPUS}" ;;
  *) echo "local_slurm.sh: error: start DIR, stop DIR or job CPUS" >&2; exit 2 ;;
esac
