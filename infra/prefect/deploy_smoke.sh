#!/usr/bin/env bash
# Deployment smoke test: a throwaway Prefect server, the work pools, the deployments of prefect.yaml,
# a process worker, and one triggered run of the `manual` deployment that must end Completed.
#
#   infra/prefect/deploy_smoke.sh [PROJECT_DIR] [-- extra `prefect deployment run` args]
#
# PROJECT_DIR (default: this checkout) is deployed and run; on a project whose pipeline is already
# reproduced every stage is skipped and the run takes about a minute. Extra args go to
# `prefect deployment run`, e.g. `-- --param promote=false`. Everything Prefect writes (database,
# logs) stays in a temp dir that is removed at the end; the server listens on 127.0.0.1 only.
# Exit status: 0 when the run completed; the server/worker logs are printed otherwise.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
project=$(cd "${1:-$here/../..}" && pwd)
shift $(( $# > 0 ? 1 : 0 ))
[[ ${1:-} == -- ]] && shift
bin=$(dirname "$(command -v python)")
[[ -x $project/.venv/bin/prefect ]] && bin=$project/.venv/bin

work=$(mktemp -d "${TMPDIR:-/tmp}/mars-deploy-smoke.XXXXXX")
export PREFECT_HOME=$work/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
export PREFECT_UI_ENABLED=false
port=$("$bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export PREFECT_API_URL=http://127.0.0.1:$port/api

pids=()  # server first, then worker
stop() {  # SIGINT (a worker shuts down on it), then SIGKILL after 20 s
  local pid=$1
  kill -INT "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  local status=$?
  # the worker before the server: a worker whose server is gone keeps retrying instead of exiting
  for (( i=${#pids[@]}-1; i>=0; i-- )); do stop "${pids[i]}"; done
  if (( status != 0 )); then
    echo "--- server log"; tail -n 40 "$work/server.log" 2>/dev/null || true
    echo "--- worker log"; tail -n 80 "$work/worker.log" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # run the cleanup when stopped from outside too

step() { echo "[deploy_smoke $(date +%H:%M:%S)] $*"; }

step "prefect server on $PREFECT_API_URL (PREFECT_HOME=$PREFECT_HOME)"
"$bin/prefect" server start --host 127.0.0.1 --port "$port" --no-ui >"$work/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 180); do
  curl -sf "$PREFECT_API_URL/health" >/dev/null && break
  kill -0 "${pids[0]}" 2>/dev/null || { echo "prefect server exited"; exit 1; }
  sleep 1
done
curl -sf "$PREFECT_API_URL/health" >/dev/null || { echo "prefect server not healthy after 180 s"; exit 1; }

cd "$project"
step "work pools: mars-process (process), mars-k8s-gpu (kubernetes, with the GPU job template)"
"$bin/prefect" work-pool create mars-process --type process --overwrite
"$bin/prefect" work-pool create mars-k8s-gpu --type kubernetes --overwrite \
  --base-job-template "$here/k8s-gpu-job-template.json"

step "deploy prefect.yaml (all deployments) from $project"
"$bin/prefect" --no-prompt deploy --all
step "deploy the GPU deployment (registered only: no Kubernetes worker here)"
"$bin/prefect" --no-prompt deploy --prefect-file "$here/k8s-gpu.prefect.yaml" --all

step "process worker"
"$bin/prefect" worker start --pool mars-process --limit 1 >"$work/worker.log" 2>&1 &
pids+=($!)

step "trigger mars-pipeline/manual and watch it"
"$bin/prefect" deployment run mars-pipeline/manual --watch --watch-timeout 600 "$@"
step "run completed"
