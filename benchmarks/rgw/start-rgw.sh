#!/usr/bin/env bash
# Start a throwaway one-node Ceph cluster that serves S3 on 127.0.0.1: one monitor, one OSD
# (memstore: data in RAM, or bluestore on a sparse file), one RADOS Gateway. No mgr, no cephx.
# Used by zarrckpt.testing.rgw (tests, benchmarks); stop it with stop-rgw.sh (same CEPH_DIR).
#
# Needs Debian's Ceph packages (16.2 on Debian 12):
#   apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd
#
# Settings (environment):
#   CEPH_DIR     cluster directory, created; must not exist or be empty  (default: $TMPDIR/zarrckpt-rgw)
#   RGW_PORT     S3 port                                                  (default 7480)
#   MON_PORT     monitor port, msgr2; msgr1 uses MON_PORT+1               (default 3300)
#   OSD_STORE    memstore | bluestore                                     (default memstore)
#   OSD_SIZE_GB  memstore's cap, or bluestore's sparse file size          (default 8)
#   S3_ACCESS_KEY, S3_SECRET_KEY                                          (default: fixed test keys)
# The OSD picks free ports in 6800-7300. RGW's ops log (one JSON record per request: operation,
# object, status, bytes in and out) goes to the unix socket $CEPH_DIR/run/ops-log.sock; whoever
# connects to it gets the records from then on (zarrckpt.testing.rgw.OpsLog counts requests so).
#
# On success prints shell exports (also in $CEPH_DIR/env) and writes $CEPH_DIR/pids.
set -euo pipefail

dir=$(realpath -m "${CEPH_DIR:-${TMPDIR:-/tmp}/zarrckpt-rgw}")
rgw_port=${RGW_PORT:-7480}
mon_port=${MON_PORT:-3300}
store=${OSD_STORE:-memstore}
size=$((${OSD_SIZE_GB:-8} * 1024 * 1024 * 1024))
access=${S3_ACCESS_KEY:-testaccesskey0000000}
secret=${S3_SECRET_KEY:-testsecretkey000000000000000000000000000}
here=$(cd "$(dirname "$0")" && pwd)
conf=$dir/ceph.conf
started=$(date +%s%N)

say() { echo "start-rgw [$((($(date +%s%N) - started) / 1000000)) ms] $*" >&2; }
fail() {
  echo "start-rgw: $*" >&2
  exit 1
}
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# wait_for SECONDS WHAT COMMAND...: poll COMMAND every 0.1 s
wait_for() {
  local seconds=$1 what=$2
  local until=$(($(date +%s) + seconds))
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$until" ] || fail "$what: not ready after ${seconds} s (logs: $dir/log)"
    sleep 0.1
  done
}
# the gateway answers an anonymous ListBuckets (GET /) with 200; bash only, no curl
s3_answers() {
  exec 4<>"/dev/tcp/127.0.0.1/$rgw_port" || return 1
  printf 'GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&4
  local status=""
  IFS= read -r -t 2 status <&4 || true
  exec 4<&-
  [[ $status == HTTP/1.?" 200"* ]]
}

case $store in memstore | bluestore) ;; *) fail "OSD_STORE must be memstore or bluestore, not $store" ;; esac
for tool in ceph ceph-mon ceph-osd monmaptool radosgw radosgw-admin; do
  command -v "$tool" >/dev/null ||
    fail "$tool not found; install Ceph: apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd"
done
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
  fail "$dir is not empty (a running cluster? stop it with $here/stop-rgw.sh)"
fi
for port in "$rgw_port" "$mon_port" "$((mon_port + 1))"; do
  ! listening "$port" || fail "127.0.0.1:$port is taken"
done
mkdir -p "$dir"/{mon,osd,rgw,run,log}
# whatever fails from here on: stop what was started, keep the logs
ok=0
trap '[ $ok = 1 ] || { KEEP_LOGS=1 CEPH_DIR="$dir" "$here/stop-rgw.sh" >&2 || true; echo "start-rgw: logs in $dir/log" >&2; }' EXIT

fsid=$(cat /proc/sys/kernel/random/uuid)
osd_uuid=$(cat /proc/sys/kernel/random/uuid)
cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$mon_port,v1:127.0.0.1:$((mon_port + 1))]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
# no cephx; then msgr2 can only run in crc mode (radosgw would otherwise insist on secure mode
# towards the monitor and retry forever)
auth cluster required = none
auth service required = none
auth client required = none
ms client mode = crc
ms service mode = crc
ms cluster mode = crc
ms mon client mode = crc
ms mon service mode = crc
ms mon cluster mode = crc
mon warn on insecure global id reclaim allowed = false
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
mon cluster log file = $dir/log/cluster.log
crash dir = $dir/log
log to stderr = false
# one replica and few placement groups: radosgw creates ~7 pools
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 1
# commit map changes quickly: the OSD boots and the gateway's pools exist within seconds
paxos propose interval = 0.1
paxos min wait = 0.01

[mon.a]
mon data = $dir/mon

[osd.0]
osd data = $dir/osd
osd objectstore = $store
memstore device bytes = $size
bluestore block path = $dir/osd.block
bluestore block create = true
bluestore block size = $size
bluestore fsck on mkfs = false
osd memory target = 1073741824
osd op num shards = 2
osd op num threads per shard = 2

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1
rgw dns name = 127.0.0.1
rgw data = $dir/rgw
rgw thread pool size = 64
# s3fs sends the client's region as the bucket's LocationConstraint: accept any
rgw relaxed region enforcement = true
rgw enable usage log = false
rgw enable ops log = true
rgw ops log rados = false
rgw ops log socket path = $dir/run/ops-log.sock
rgw ops log data backlog = 67108864
# collect the tails of deleted objects after ~30 s, not 2 h (memstore keeps them in RAM)
rgw gc obj min wait = 30
rgw gc processor period = 30
EOF
ceph=(ceph -c "$conf" --connect-timeout 10)

monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port,v1:127.0.0.1:$((mon_port + 1))]" \
  "$dir/monmap" >/dev/null
ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap"
ceph-mon -c "$conf" -i a
wait_for 20 "monitor" "${ceph[@]}" mon stat
say "monitor up on 127.0.0.1:$mon_port"

id=$("${ceph[@]}" osd new "$osd_uuid")
[ "$id" = 0 ] || fail "the new OSD got id $id, not 0"
ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$dir/log/osd-mkfs.log" 2>&1 ||
  fail "OSD mkfs failed: $(tail -5 "$dir/log/osd-mkfs.log")"
ceph-osd -c "$conf" -i 0 2>>"$dir/log/osd.stderr"
osd_up() { "${ceph[@]}" osd dump | grep -q '^osd.0 up'; }
wait_for 30 "OSD" osd_up
say "OSD up ($store)"

radosgw -c "$conf" -n client.rgw 2>>"$dir/log/rgw.stderr"
wait_for 60 "radosgw" s3_answers
say "radosgw answering on 127.0.0.1:$rgw_port"
timeout 60 radosgw-admin -c "$conf" user create --uid=zarrckpt --display-name=zarrckpt \
  --access-key="$access" --secret="$secret" >"$dir/user.json"

for name in mon.a osd.0 client.rgw; do echo "$name $(cat "$dir/run/$name.pid")"; done >"$dir/pids"
cat >"$dir/env" <<EOF
export S3_ENDPOINT_URL=http://127.0.0.1:$rgw_port
export AWS_ACCESS_KEY_ID=$access
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_DEFAULT_REGION=us-east-1
export CEPH_CONF=$conf
export RGW_OPS_LOG=$dir/run/ops-log.sock
EOF
cat "$dir/env"
ok=1
say "ready; stop with: CEPH_DIR=$dir $here/stop-rgw.sh"
