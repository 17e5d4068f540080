#!/usr/bin/env bash
# A profile's whole study from nothing, offline: `infra/study.sh smollm2` (or `make study PROFILE=smollm2`).
#   infra/study.sh PROFILE [NAME -S KEY=VALUE ...]   a variant: its own clone and results/NAME/
#
# It runs in its own clone of this checkout's HEAD (build/study-NAME, NAME defaulting to PROFILE), so
# the checkout keeps the default profile's params.yaml and outputs: `dvc exp run -S profile=PROFILE
# [-S ...]` there, then the results go to results/NAME/ here (flows/results.py), whatever the exit
# status. Resumable: run the same command again; DVC skips finished stages, distill resumes from its
# shards, training from its step checkpoints. In the background:
#   nohup infra/study.sh smollm2 > build/study-smollm2.log 2>&1 &
set -uo pipefail
invocation="infra/study.sh $*"
profile=${1:?usage: infra/study.sh PROFILE [NAME -S KEY=VALUE ...]}
name=${2:-$profile}
shift $(( $# >= 2 ? 2 : 1 ))
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
# the project's venv (make install) when dvc is not on PATH; checked before anything runs, so a missing
# tool cannot end a study whose collection would then replace the last results with nothing
if ! command -v dvc > /dev/null && [ -x "$root/.venv/bin/dvc" ]; then
  PATH="$root/.venv/bin:$PATH"
fi
if ! command -v dvc > /dev/null; then
  echo "infra/study.sh: dvc not found: run \`make install\` (it makes $root/.venv) or put dvc on PATH" >&2
  exit 127
fi
work=$root/build/study-$name
if [ ! -d "$work/.git" ]; then
  git clone -q "$root" "$work" || exit 1
fi
cd "$work" || exit 1
export PYTHONPATH=$work  # the clone's code, not the checkout's (the venv's editable install points there)
echo "study $name ($profile $*): $(git rev-parse HEAD) in $work, $(date -u +%FT%TZ)"
dvc exp run -S "profile=$profile" "$@"
status=$?
python -m flows.results "$work" "$root/results/$name" --profile "$profile" \
  --command "$invocation" --status "$status"
exit $status
