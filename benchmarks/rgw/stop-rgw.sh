#!/usr/bin/env bash
# Stop the cluster start-rgw.sh started in $CEPH_DIR and delete that directory.
# Signals only the PIDs in $CEPH_DIR/run/*.pid whose command line names $CEPH_DIR/ceph.conf:
# the gateway first, then the OSD, then the monitor (each one's shutdown needs the next);
# TERM, up to 5 s, then KILL. KEEP_LOGS=1 keeps $CEPH_DIR/log (and the directory).
set -uo pipefail

dir=$(realpath -m "${CEPH_DIR:-${TMPDIR:-/tmp}/zarrckpt-rgw}")

ours() { [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- "$dir/ceph.conf"; }

stop() {
  local file=$dir/run/$1.pid pid tick
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  ours "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for tick in $(seq 50); do
    [ -d "/proc/$pid" ] || return 0
    sleep 0.1
  done
  ours "$pid" && kill -KILL "$pid" 2>/dev/null && echo "stop-rgw: $1 ($pid) killed after 5 s" >&2
  return 0
}

[ -d "$dir" ] || exit 0
for name in client.rgw osd.0 mon.a; do stop "$name"; done
rm -f "$dir/pids"
if [ "${KEEP_LOGS:-0}" = 1 ]; then
  find "$dir" -mindepth 1 -maxdepth 1 ! -name log -exec rm -rf {} +
else
  rm -rf "$dir"
fi
