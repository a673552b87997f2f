#!/usr/bin/env bash
# A real Slurm cluster on this machine, for the tests marked `slurm` (docs/launch.md, "The test cluster").
#
#   tests/slurm/cluster.sh up     install Slurm + munge from the distribution where missing (root, apt-get),
#                                 write slurm.conf for this machine, start munged, slurmctld and two slurmd
#                                 (nodes n1 and n2 on this host, own ports; Debian's build has multiple-slurmd
#                                 support), wait until sinfo shows both idle; prints `export SLURM_CONF=...`
#   tests/slurm/cluster.sh down   stop what `up` started, by the process ids in its pid files (never by name)
#   tests/slurm/cluster.sh env    print the SLURM_CONF line of a cluster that is up
#
# Everything lives in $SLURM_TEST_DIR (default /tmp/bridge-ext-slurm): the config, munge's own key and socket,
# state, spool, logs and pid files; a system munged or Slurm is left alone. Partition `cpu` (default; 30-minute
# limit, enforced at submission as on most clusters); accounting off, so accounts are not enforced.
set -euo pipefail
DIR=${SLURM_TEST_DIR:-/tmp/bridge-ext-slurm}
CONF=$DIR/slurm.conf
NODES=(n1 n2)
CTLD_PORT=${SLURM_TEST_PORT:-16817}
say() { echo "slurm-cluster: $*" >&2; }
die() { say "error: $*"; exit 2; }

install_packages() {
  local missing=()
  for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return
  [ "$(id -u)" = 0 ] || die "Slurm is not installed (${missing[*]}) and installing needs root: apt-get install ${missing[*]}"
  say "installing ${missing[*]} (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >"$DIR/apt.log" 2>&1 \
    || { apt-get update -q >>"$DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
         --no-install-recommends "${missing[@]}" >>"$DIR/apt.log" 2>&1; } || die "apt-get failed: $DIR/apt.log"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  # a node's memory: a quarter of what is available now (two nodes share it; jobs ask for none by default)
  mem=$(( $(awk '/MemAvailable/ {print int($2 / 1024)}' /proc/meminfo) / 4 ))
  cat >"$CONF" <<EOF
# written by tests/slurm/cluster.sh
ClusterName=bridgeext
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: a requeued job may start again after this long (Slurm default 120 s; tests requeue)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
EnforcePartLimits=ALL
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
EOF
  local port=$((CTLD_PORT + 1))
  for node in "${NODES[@]}"; do
    echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=$cpus RealMemory=$mem State=UNKNOWN" >>"$CONF"
    port=$((port + 1))
  done
  echo "PartitionName=cpu Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=00:30:00 State=UP OverSubscribe=NO" >>"$CONF"
}

start_munge() {
  local key=$DIR/munge/munge.key
  if alive "$DIR/munge/munged.pid"; then return; fi
  id munge >/dev/null 2>&1 || die "no user 'munge' (the munge package creates it)"
  mkdir -p "$DIR/munge"
  [ -f "$key" ] || head -c 1024 /dev/urandom >"$key"
  chown -R munge: "$DIR/munge"
  chmod 755 "$DIR/munge"
  chmod 400 "$key"
  runuser -u munge -- /usr/sbin/munged --key-file="$key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || die "munged did not start: $DIR/munge/munged.log"
}

up() {
  mkdir -p "$DIR"/{state,spool,run,log}
  chmod 755 "$DIR"
  install_packages
  start_munge
  alive "$DIR/run/slurmctld.pid" || write_conf  # the running daemons keep the file they read
  export SLURM_CONF=$CONF
  alive "$DIR/run/slurmctld.pid" || /usr/sbin/slurmctld -f "$CONF" -i || die "slurmctld did not start: $DIR/log/slurmctld.log"
  for node in "${NODES[@]}"; do
    mkdir -p "$DIR/spool/$node"
    alive "$DIR/run/slurmd-$node.pid" || /usr/sbin/slurmd -f "$CONF" -N "$node" \
      || die "slurmd $node did not start: $DIR/log/slurmd-$node.log"
  done
  local start=$SECONDS
  until [ "$(sinfo -h -p cpu -t idle -o '%D' 2>/dev/null)" = "${#NODES[@]}" ]; do
    [ $((SECONDS - start)) -lt 60 ] || { sinfo >&2 || true; die "nodes not idle after 60 s: $DIR/log/"; }
    sleep 0.5
  done
  say "up in $((SECONDS - start)) s after the daemons started: $(sinfo -h -o '%P %D %T %l' | tr '\n' ' ')"
  echo "export SLURM_CONF=$CONF"
}

down() {
  local pidfile pid
  for pidfile in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/munge/munged.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$pidfile"
  done
  say "down"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  env) [ -f "$CONF" ] && alive "$DIR/run/slurmctld.pid" || die "no cluster up in $DIR"; echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
