#!/usr/bin/env bash
# Second stage of a mutation run: every mutant the core's unit tests missed is applied, alone, to
# a scratch worktree of HEAD and judged by a short simulator sweep (every scenario file at a few
# seeds: the truth oracles, the in-run invariants, node health). Prints one `caught|missed<TAB>NAME`
# line a mutant, for `scripts/mutants-summary.py --replayed`; progress goes to stderr.
#
#   scripts/mutants-sweep.sh mutants.out [SEEDS] > sweep.tsv      # SEEDS: 0..2 by default
#
# HEAD must hold the tree the mutation run measured (the diffs are applied with `patch -p0`).
# Each mutant rebuilds the core, the shell, the simulated DC and the simulator (~1 min on two
# cores), which is why the sweep is a second stage and not cargo-mutants' own test command.
set -euo pipefail
out=${1:?usage: scripts/mutants-sweep.sh MUTANTS_OUT [SEEDS]}
seeds=${2:-0..2}
out=$(cd "$out" && pwd)
[[ -f $out/outcomes.json ]] || { echo "no outcomes.json in $out" >&2; exit 2; }
repo=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
tree=$work/tree
git -C "$repo" worktree add --detach -q "$tree" HEAD
trap 'git -C "$repo" worktree remove --force "$tree"; rm -rf "$work"' EXIT
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$work/target}

python3 "$repo/scripts/mutants-summary.py" --missed-diffs "$out/outcomes.json" > "$work/missed"
total=$(wc -l < "$work/missed")
echo "== $total missed mutants, sweep --seeds $seeds each (target: $CARGO_TARGET_DIR)" >&2
sim=$CARGO_TARGET_DIR/mutants/kvrelay-sim
build() { (cd "$tree" && cargo build -q --profile mutants -p kvrelay-sim --bin kvrelay-sim); }
build >&2 || { echo "the unmutated tree does not build" >&2; exit 2; }
(cd "$tree" && "$sim" sweep scenarios --seeds "$seeds" > "$work/baseline.log" 2>&1) \
    || { echo "the unmutated tree fails the sweep: $work/baseline.log" >&2; cat "$work/baseline.log" >&2; exit 2; }

n=0
while IFS=$'\t' read -r diff name; do
    n=$((n + 1))
    (cd "$tree" && patch -s -p0 < "$out/$diff")
    started=$SECONDS
    if ! build > "$work/build.log" 2>&1; then
        verdict=unviable
    elif (cd "$tree" && timeout 600 "$sim" sweep scenarios --seeds "$seeds" > "$work/sweep.log" 2>&1); then
        verdict=missed
    else
        verdict=caught
    fi
    (cd "$tree" && patch -s -R -p0 < "$out/$diff")
    printf '%s\t%s\n' "$verdict" "$name"
    echo "[$n/$total] $verdict in $((SECONDS - started)) s: $name" >&2
done < "$work/missed"
