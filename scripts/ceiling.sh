#!/usr/bin/env bash
# ceiling.sh — the highest stored-event rate each relay follows with no loss on one core, side by
# side: kvrelay and NVIDIA Dynamo 1.6.1's relay, each alone in turn on the same loadgen stream
# (loadgen's output is a function of its seed, the rate), through scripts/ingest-cpu.sh.
#
# The relay is pinned to CPU $RELAY_CPU; nats-server, loadgen and its verifier to $OTHERS_CPU.
# For each relay the rates of $RATES are tried in ascending order. A rate is *followed* when
#   - loadgen achieved at least 99 % of it (else loadgen, not the relay, is the limit: the walk
#     stops and the ceiling is reported as "at least" the last rate followed),
#   - the relay used less than $CPU_MAX % of its core over the window (at 100 % it falls behind,
#     and a backlog that it works off after the run would pass the other checks),
#   - neither the relay's NATS client (kvrelay's metric) nor nats-server (its slow-consumer count)
#     dropped a message,
#   - and loadgen's verifier found every live key in the relay's published filters afterwards.
# The walk stops at the first rate not followed; $BISECT more runs then halve the interval
# between the last rate followed and it. The last line per relay is its ceiling, and at the end
# kvrelay's ceiling over Dynamo's.
#
# Prerequisites: those of scripts/ingest-cpu.sh for both relays (release kvrelay and loadgen,
# nats-server, ../shared/tools/dynamo-live/install.sh).
#
# Settings (environment), besides ingest-cpu.sh's shape (BLOCKS, POOLS, WORKERS, RANKS, CHAIN,
# LIVE_CAP) and paths (TARGET_DIR, DYNLIVE):
#   RELAYS="dynamo kvrelay"    which relays, in this order
#   RATES="5000 10000 20000 30000 40000 60000 80000 120000"   stored events/s, ascending
#   BISECT=2                   halvings after the first rate not followed
#   CPU_MAX=90                 the relay's CPU share of its core above which it is saturated
#   MEASURE_SECS=10 IDLE_SECS=2 WARMUP_SECS=3
#   RELAY_CPU=1 OTHERS_CPU=0   the relay's core, and the rest's
#   OUT=/tmp/kvrelay-ceiling   every run's ingest-cpu.sh table and logs
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RELAYS="${RELAYS:-dynamo kvrelay}"
RATES="${RATES:-5000 10000 20000 30000 40000 60000 80000 120000}"
BISECT="${BISECT:-2}" CPU_MAX="${CPU_MAX:-90}"
RELAY_CPU="${RELAY_CPU:-1}" OTHERS_CPU="${OTHERS_CPU:-0}"
OUT="${OUT:-/tmp/kvrelay-ceiling}"
export MEASURE_SECS="${MEASURE_SECS:-10}" IDLE_SECS="${IDLE_SECS:-2}" WARMUP_SECS="${WARMUP_SECS:-3}"

die() { echo "ceiling: $*" >&2; exit 2; }
(( $(nproc) >= 2 )) || die "needs 2 CPUs (the relay on one, the rest on the other)"
rm -rf "$OUT"; mkdir -p "$OUT"

# run RELAY RATE: one ingest-cpu.sh run (its whole table, WAN and NATS bytes included, kept in
# $OUT/RELAY-RATE.out); prints its row (empty when the run failed).
run() {
  RELAY="$1" RATES="$2" TASKSET="$RELAY_CPU" OTHERS_TASKSET="$OTHERS_CPU" OUT="$OUT/$1-$2" \
    bash "$ROOT/scripts/ingest-cpu.sh" 2>"$OUT/$1-$2.err" | tee "$OUT/$1-$2.out" | grep "^| $2 |" || true
}
# verdict RATE ROW: "followed", "loadgen" (loadgen fell short of the rate) or why not followed.
verdict() {
  awk -F'|' -v rate="$1" -v cpu_max="$CPU_MAX" '{
    gsub(/ /, "")
    achieved = $3; cpu = $7; drops = $14; slow = $15; verify = $16
    if (achieved < 0.99 * rate) { print "loadgen"; exit }
    why = ""
    if (cpu >= cpu_max) why = why " cpu " cpu "%"
    if (drops != "-" && drops != 0) why = why " client drops " drops
    if (slow != 0) why = why " nats slow consumers " slow
    if (verify != "ok") why = why " verify " verify
    print (why == "" ? "followed" : "not followed:" why)
  }' <<<"$2"
}

# try RATE: one run of $relay, its row printed, and best / failed / limit moved; returns 0 when
# followed, 1 when not, 2 when loadgen fell short; a run that did not complete ends the script.
try() {
  local rate="$1" row v
  row="$(run "$relay" "$rate")"
  if [[ -z "$row" ]]; then
    v="run failed (see $OUT/$relay-$rate.err)"
    echo "| $relay | $rate | - | - | - | - | - | - | $v |"
  else
    v="$(verdict "$rate" "$row")"
    awk -F'|' -v relay="$relay" -v v="$v" '{
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", relay, $2, $3, $4, $7, $14, $15, $16, v }' \
      <<<"$row"
  fi
  case "$v" in
    followed) best="$rate" ;;
    loadgen) limit="$rate"; return 2 ;;
    "run failed"*) die "$relay at $rate: $v" ;;
    *) failed="$rate"; return 1 ;;
  esac
}

declare -A CEILING=()
for relay in $RELAYS; do
  echo "== $relay (pinned to CPU $RELAY_CPU; loadgen, verifier and nats-server on CPU $OTHERS_CPU)"
  echo "| relay | rate asked | achieved | µs/event | CPU % of a core | client drops | NATS slow consumers | verify | verdict |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
  best=0 failed=0 limit=""
  for rate in $RATES; do try "$rate" || break; done
  for ((i = 0; i < BISECT; i++)); do
    [[ "$failed" -gt 0 && -z "$limit" ]] || break
    mid=$(( (best + failed) / 2 / 500 * 500 ))
    (( mid > best && mid < failed )) || break
    rc=0; try "$mid" || rc=$?
    (( rc != 2 )) || break
  done
  if [[ -n "$limit" ]]; then
    CEILING[$relay]="$best+"
    echo "$relay: follows at least $best stored events/s (loadgen fell short at $limit: the ceiling is above what this machine's loadgen publishes)"
  elif [[ "$failed" == 0 ]]; then
    CEILING[$relay]="$best+"
    echo "$relay: follows every rate tried, up to $best stored events/s"
  else
    CEILING[$relay]="$best"
    echo "$relay: ceiling $best stored events/s (not followed at $failed)"
  fi
  echo
done

if [[ -n "${CEILING[kvrelay]:-}" && -n "${CEILING[dynamo]:-}" ]]; then
  k="${CEILING[kvrelay]}" d="${CEILING[dynamo]}"
  awk -v k="${k%+}" -v d="${d%+}" -v kopen="${k//[0-9]/}" -v dopen="${d//[0-9]/}" 'BEGIN {
    if (d == 0) { print "ceiling ratio: Dynamo followed no rate tried"; exit }
    if (kopen == "+" && dopen == "+") { print "ceiling ratio: neither ceiling was reached; try higher rates"; exit }
    bound = kopen == "+" && dopen == "" ? "at least " : (dopen == "+" && kopen == "" ? "at most " : "")
    printf "ceiling ratio (kvrelay / dynamo): %s%.2fx (%s / %s stored events/s; goal >= 4x)\n",
      bound, k / d, k kopen, d dopen }'
fi
echo "shape: BLOCKS=${BLOCKS:-1} POOLS=${POOLS:-1} WORKERS=${WORKERS:-2} RANKS=${RANKS:-1} CHAIN=${CHAIN:-0.5} LIVE_CAP=${LIVE_CAP:-50000}; window ${MEASURE_SECS}s; CPU_MAX ${CPU_MAX}%; logs in $OUT"
