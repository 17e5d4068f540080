#!/usr/bin/env bash
# A profile's whole study from nothing, offline: `infra/study.sh smollm2` (or `make study PROFILE=smollm2`).
#   infra/study.sh PROFILE [NAME [--from STUDY] -S KEY=VALUE ...]   a variant: its own clone and results/NAME/
#
# It runs in its own clone of this checkout's HEAD (build/study-NAME, NAME defaulting to PROFILE), so
# the checkout keeps the default profile's params.yaml and outputs: `dvc exp run -S profile=PROFILE
# [-S ...]` there, then the results go to results/NAME/ here (flows/results.py), whatever the exit
# status. Resumable: run the same command again; DVC skips finished stages, distill resumes from its
# shards, training from its step checkpoints. In the background:
#   nohup infra/study.sh smollm2 > build/study-smollm2.log 2>&1 &
#
# A variant overrides the profile's own keys (`-S profiles.smollm2.train.mars.epochs=1`): a top-level key
# the profile also sets would be replaced by the profile's value, so it is refused before anything runs.
# A new variant's clone starts from the profile's study (build/study-PROFILE): its dvc.lock, its DVC cache
# and the stage outputs it has (the base, the distilled pool, the prepared data, final checkpoints, the finished
# decodings of evaluate), so the stages whose params, code and inputs the variant leaves alone are skipped, the
# distillation above all, and evaluate decodes only what changed (the base's outputs are reused).
# `--from STUDY` starts it from build/study-STUDY instead: variants of a variant's pool distil it once
# (`infra/study.sh smollm2 pool-b8 --from pool -S ...`, repeating pool's own overrides).
# Keys the profile lacks are added as dvc exp run adds them: `-S +profiles.tiny.train.lr=0.002`.
set -uo pipefail
invocation="infra/study.sh $*"
usage="usage: infra/study.sh PROFILE [NAME [--from STUDY] -S KEY=VALUE ...]"
profile=${1:?$usage}
name=${2:-$profile}
shift $(( $# >= 2 ? 2 : 1 ))
case $name in -*) echo "infra/study.sh: NAME comes before the options, got '$name'; $usage" >&2; exit 2;; esac
from=$profile
if [ "${1:-}" = "--from" ]; then
  from=${2:?$usage}
  shift 2
  if [ "$name" = "$profile" ]; then
    echo "infra/study.sh: --from $from: the profile's own study starts from nothing; name a variant" >&2
    exit 2
  fi
fi
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
# the project's venv (make install) when dvc is not on PATH; checked before anything runs, so a missing
# tool cannot end a study whose collection would then replace the last results with nothing
if ! { command -v dvc && command -v mars; } > /dev/null && [ -x "$root/.venv/bin/dvc" ]; then
  PATH="$root/.venv/bin:$PATH"
fi
for tool in dvc mars; do
  if ! command -v $tool > /dev/null; then
    echo "infra/study.sh: $tool not found: run \`make install\` (it makes $root/.venv) or put $tool on PATH" >&2
    exit 127
  fi
done
# the overrides as the stages will read them: a bad key, or one the profile would replace, stops it here
(cd "$root" && mars params -S "profile=$profile" "$@" > /dev/null) || exit 2
work=$root/build/study-$name
seed=$root/build/study-$from
if [ "$from" != "$profile" ] && [ ! -f "$seed/dvc.lock" ]; then
  echo "infra/study.sh: --from $from: $seed has no dvc.lock (run that study first)" >&2
  exit 2
fi
if [ ! -d "$work/.git" ]; then
  git clone -q "$root" "$work" || exit 1
  if [ "$name" != "$profile" ] && [ -f "$seed/dvc.lock" ]; then
    echo "study $name: starting from $seed's dvc.lock, outputs and DVC cache"
    cp "$seed/dvc.lock" "$work/dvc.lock"
    # its cache too: DVC takes an output that its cache lacks for a changed stage
    cache=$(cd "$seed" && dvc cache dir) && (cd "$work" && dvc cache dir --local "$cache") || exit 1
    for out in models/base data/distilled data/distill_work data/prepared checkpoints/*/final eval_work; do
      for path in "$seed"/$out; do
        [ -e "$path" ] || continue
        mkdir -p "$work/$(dirname "${path#"$seed"/}")"
        cp -a --reflink=auto "$path" "$work/${path#"$seed"/}" || exit 1
      done
    done
  fi
fi
cd "$work" || exit 1
export PYTHONPATH=$work  # the clone's code, not the checkout's (the venv's editable install points there)
echo "study $name ($profile $*): $(git rev-parse HEAD) in $work, $(date -u +%FT%TZ)"
started=$(date +%s)
# a resumed run applies its overrides to the committed params again: the last run's params.yaml has the
# keys a `+KEY=VALUE` adds, and dvc exp run refuses to add one twice
git checkout -q HEAD -- params.yaml || exit 1
dvc exp run -S "profile=$profile" "$@"
status=$?
python -m flows.results "$work" "$root/results/$name" --profile "$profile" \
  --command "$invocation" --status "$status" --started "$started"
exit $status
