#!/usr/bin/env bash
# A real Slurm cluster on this machine, for the tests marked `slurm` (docs/launch.md, "The test cluster").
#
#   tests/slurm/cluster.sh up     install Slurm, munge, slurmdbd and MariaDB from the distribution where missing
#                                 (root, apt-get), write slurm.conf for this machine, start munged, a private
#                                 mariadbd and slurmdbd (cluster, account `tests` and user root registered),
#                                 slurmctld and two slurmd
#                                 (nodes n1 and n2 on this host, own ports; Debian's build has multiple-slurmd
#                                 support), wait until sinfo shows both idle; prints `export SLURM_CONF=...`
#   tests/slurm/cluster.sh down   stop what `up` started, by the process ids in its pid files (never by name)
#   tests/slurm/cluster.sh env    print the SLURM_CONF line of a cluster that is up
#
# Everything lives in $SLURM_TEST_DIR (default /tmp/bridge-ext-slurm): the config, munge's own key and socket,
# state, spool, logs, pid files and the MariaDB data dir; a system munged, MariaDB or Slurm is left alone. Partition
# `cpu` (default; 30-minute limit, enforced at submission as on most clusters). Accounting through slurmdbd with
# AccountingStorageEnforce=associations: the scheduler refuses an account other than `tests` (root's default).
# Ports: slurmctld $SLURM_TEST_PORT (default 16817), slurmd the next ones, slurmdbd +10, mariadbd +11 (127.0.0.1).
set -euo pipefail
DIR=${SLURM_TEST_DIR:-/tmp/bridge-ext-slurm}
CONF=$DIR/slurm.conf
NODES=(n1 n2)
CTLD_PORT=${SLURM_TEST_PORT:-16817}
DBD_PORT=$((CTLD_PORT + 10))
DB_PORT=$((CTLD_PORT + 11))
DB_SOCK=$DIR/mysql/mysqld.sock
say() { echo "slurm-cluster: $*" >&2; }
die() { say "error: $*"; exit 2; }

install_packages() {
  local missing=()
  for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge slurmdbd:slurmdbd \
              mariadbd:mariadb-server; do
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
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$host
AccountingStoragePort=$DBD_PORT
# the munge socket for talking to slurmdbd (AuthInfo's is not used for that)
AccountingStoragePass=$DIR/munge/munge.socket
# a job's account must have an association (cluster, account, user) in slurmdbd, as on real clusters
AccountingStorageEnforce=associations
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
# debug2 logs each time-limit sweep ("Testing job time limits", every 30 s): the Slurm test times its
# time-limited job by it (tests/test_slurm.py, submit_before_a_sweep)
SlurmctldDebug=debug2
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

start_mariadb() {
  if alive "$DIR/run/mariadbd.pid"; then return; fi
  # as root like the Slurm daemons: its pid file and log go to the root-owned run/ and log/.
  # --no-defaults: the system's /etc/mysql (socket, port 3306, datadir) must not apply
  [ -d "$DIR/mysql/mysql" ] || mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql" \
    --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 \
    || die "mariadb-install-db failed: $DIR/log/mariadb-install.log"
  # mariadbd does not daemonize: own session, no inherited stdout (the caller's $(...) would wait for it)
  setsid /usr/sbin/mariadbd --no-defaults --user=root --datadir="$DIR/mysql" --socket="$DB_SOCK" \
    --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$DIR/run/mariadbd.pid" \
    --log-error="$DIR/log/mariadbd.log" </dev/null >>"$DIR/log/mariadbd.log" 2>&1 &
  local pid=$! start=$SECONDS
  until mariadb-admin --no-defaults -S "$DB_SOCK" -u root ping >/dev/null 2>&1 && alive "$DIR/run/mariadbd.pid"; do
    kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -lt 60 ] || die "mariadbd did not start: $DIR/log/mariadbd.log"
    sleep 0.5
  done
}

start_slurmdbd() {
  local pass=$DIR/mysql.pass
  if alive "$DIR/run/slurmdbd.pid"; then return; fi
  [ -s "$pass" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr '/+' '_-' >"$pass")
  # root over the socket (unix_socket auth); slurmdbd over TCP, which its MySQL plugin always uses for a host
  mariadb --no-defaults -S "$DB_SOCK" -u root <<EOF >>"$DIR/log/mariadbd.log" 2>&1 || die "creating the slurmdbd database user failed: $DIR/log/mariadbd.log"
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$pass")';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
  # slurmdbd reads slurmdbd.conf next to $SLURM_CONF; it must be mode 600 and owned by SlurmUser
  (umask 077; cat >"$DIR/slurmdbd.conf" <<EOF
# written by tests/slurm/cluster.sh
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
DbdHost=$(hostname -s)
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$pass")
StorageLoc=slurm_acct_db
EOF
  )
  /usr/sbin/slurmdbd || die "slurmdbd did not start: $DIR/log/slurmdbd.log"
  local start=$SECONDS
  until sacctmgr -n -P list cluster >/dev/null 2>&1; do
    [ $((SECONDS - start)) -lt 60 ] || die "slurmdbd does not answer after 60 s: $DIR/log/slurmdbd.log"
    sleep 0.5
  done
}

# the association root/tests on cluster bridgeext, in place before slurmctld first registers with slurmdbd
register_accounts() {
  local log=$DIR/log/sacctmgr.log
  [ -n "$(sacctmgr -n -P list cluster bridgeext format=cluster)" ] \
    || sacctmgr -i add cluster bridgeext >>"$log" 2>&1 || return
  [ -n "$(sacctmgr -n -P list account tests format=account)" ] \
    || sacctmgr -i add account tests cluster=bridgeext >>"$log" 2>&1 || return
  [ -n "$(sacctmgr -n -P list association cluster=bridgeext account=tests user=root format=user)" ] \
    || sacctmgr -i add user root account=tests cluster=bridgeext >>"$log" 2>&1 || return
  # slurmdbd creates root with default account root; jobs without --account go to tests instead
  [ "$(sacctmgr -n -P show user root format=defaultaccount)" = tests ] \
    || sacctmgr -i modify user where name=root set defaultaccount=tests >>"$log" 2>&1
}

up() {
  mkdir -p "$DIR"/{state,spool,run,log}
  chmod 755 "$DIR"
  install_packages
  start_munge
  alive "$DIR/run/slurmctld.pid" || write_conf  # the running daemons keep the file they read
  export SLURM_CONF=$CONF
  start_mariadb
  start_slurmdbd
  register_accounts || die "sacctmgr could not register cluster, account and user: $DIR/log/sacctmgr.log"
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

# stop_group PIDFILE...: SIGTERM to each (by its pid file), then wait for all of them (SIGKILL after 10 s)
stop_group() {
  local pidfile pid pids=()
  for pidfile in "$@"; do
    pid=$(cat "$pidfile" 2>/dev/null) || continue  # a daemon removes its pid file as it exits
    if kill "$pid" 2>/dev/null; then pids+=("$pid"); fi
    rm -f "$pidfile"
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  done
  return 0
}

# the daemons in waves, each after those that talk to it: slurmd + slurmctld, slurmdbd, then its database and munge
down() {
  stop_group "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"
  stop_group "$DIR/run/slurmdbd.pid"
  stop_group "$DIR/run/mariadbd.pid" "$DIR/munge/munged.pid"
  say "down"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  env) [ -f "$CONF" ] && alive "$DIR/run/slurmctld.pid" || die "no cluster up in $DIR"; echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
