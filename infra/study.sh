#!/usr/bin/env bash
# A profile's whole study from nothing, offline: `infra/study.sh smollm2` (or `make study PROFILE=smollm2`).
#
# It runs in its own clone of this checkout's HEAD (build/study-PROFILE), so the checkout keeps the
# default profile's params.yaml and outputs: `dvc exp run -S profile=PROFILE` there, then the results
# go to results/PROFILE/ here (flows/results.py), whatever the exit status. Resumable: run the same
# command again; DVC skips finished stages, distill resumes from its shards, training from its step
# checkpoints. A run in the background: `nohup infra/study.sh smollm2 > build/study-smollm2.log 2>&1 &`.
set -uo pipefail
profile=${1:?usage: infra/study.sh PROFILE}
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$root/build/study-$profile
if [ ! -d "$work/.git" ]; then
  git clone -q "$root" "$work" || exit 1
fi
cd "$work" || exit 1
export PYTHONPATH=$work  # the clone's code, not the checkout's (the venv's editable install points there)
echo "study $profile: $(git rev-parse HEAD) in $work, $(date -u +%FT%TZ)"
dvc exp run -S "profile=$profile"
status=$?
python -m flows.results "$work" "$root/results/$profile" --profile "$profile" --command "infra/study.sh $profile" \
  --status "$status"
exit $status
