#!/usr/bin/env bash
# side-by-side.sh — run NVIDIA Dynamo 1.6.1's KV DC relay (`python -m dynamo.kv_dc_relay`) and
# `kvrelay serve` on the same real Dynamo workers, compare what they publish through kvrelay's
# reference consumer, and measure both relays' CPU per event and memory.
#
# What it does (everything on 127.0.0.1, every process it starts is stopped by PID on exit):
#   1. starts nats-server (event plane), Dynamo's relay on $DYNAMO_BIND and `kvrelay serve` on
#      $KVRELAY_BIND, both with the same Dynamo environment (file discovery in a private
#      directory, NATS, --dc-id dc-a, default scope = every namespace);
#   2. phase "topology": real workers (worker.py on Dynamo's Python bindings) covering an
#      aggregated pool with LoRA adapters, an alias and parent-chained events, a prefill/decode
#      pair, a DP=2 worker, an Eagle worker and a prefill without its decode; they publish KV
#      events for $TOPOLOGY_PUBLISH_SECS s and stay registered; then `kvrelay-compare` follows
#      both relays and requires catalog, readiness, load and filter membership to agree
#      (a pool whose load kvrelay alone observed on every rank is reported, and accepted: the
#      DP=2 worker reports its idle rank once, at start-up, often before Dynamo's relay
#      discovers it; kvrelay keeps such early reports, see README "Discovery");
#   3. idle baseline: $IDLE_SECS s of relay CPU with every pool subscribed and no events;
#   4. phase "rate R" for each R in $RATES: one more worker publishes R stored events/s
#      (1 block each) for $WARMUP_SECS + $MEASURE_SECS s while `kvrelay-compare` subscribes to
#      every pool of both relays; CPU (user+sys from /proc/PID/stat) of both relays is sampled
#      over the last $MEASURE_SECS s and divided by the events published in that window (from
#      the worker's own counters), also net of the idle baseline; RSS is read from
#      /proc/PID/status (VmRSS, VmHWM); after the worker stops publishing the comparison must
#      agree again;
#   5. `kvrelay query` on both relays with prompts from the aggregated worker's trace (live
#      base-model, alias and LoRA chains, and an evicted chain): the answers must be equal;
#   6. prints a summary table and exits 0 when every comparison matched, 1 otherwise (2 when a
#      prerequisite is missing or the stack did not start).
#
# Prerequisites (checked; the script says what is missing):
#   - ../shared/tools/dynamo-live/install.sh has run: $DYNLIVE/venv with ai-dynamo 1.6.1,
#     nats-server on PATH, the tiny model directory $DYNLIVE/models/tiny-llm;
#   - release binaries: `cargo build --release -p kvrelay` (builds kvrelay and kvrelay-compare).
#
# Usage: scripts/side-by-side.sh            (re-runnable; state under $SBS_DIR, wiped first)
# Settings (environment):
#   RATES="1000 5000"        stored events/s of the measured phases
#   MEASURE_SECS=30          CPU window per rate;  WARMUP_SECS=5 before it
#   TOPOLOGY_PUBLISH_SECS=8  how long the topology workers publish
#   COMPARE_TIMEOUT_SECS=60  how long a comparison may take to converge
#   MAX_LIVE_BLOCKS=0        >0: the rate worker also evicts (removed events) above this many blocks
#   IDLE_SECS=15             idle CPU baseline window (subtracted for the marginal µs/event)
#   DYNLIVE=/tmp/dynlive     venv + model (install.sh);   SBS_DIR=/tmp/kvrelay-sbs  state + logs
#   DYNAMO_BIND=127.0.0.1:5561  KVRELAY_BIND=127.0.0.1:5562  NATS_PORT=4222
#   KVRELAY_OPS_BIND=127.0.0.1:9464  kvrelay's /metrics and health listener (`off` disables it)
#   KVRELAY_BIN, COMPARE_BIN  default target/release/{kvrelay,kvrelay-compare}
#   KVRELAY_ENV=""           extra NAME=VALUE settings for kvrelay only (e.g. MALLOC_ARENA_MAX=2)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${DYNAMO_LIVE:-$ROOT/../shared/tools/dynamo-live}"
export DYNLIVE="${DYNLIVE:-/tmp/dynlive}"
SBS_DIR="${SBS_DIR:-/tmp/kvrelay-sbs}"
RATES="${RATES:-1000 5000}"
MEASURE_SECS="${MEASURE_SECS:-30}"
WARMUP_SECS="${WARMUP_SECS:-5}"
TOPOLOGY_PUBLISH_SECS="${TOPOLOGY_PUBLISH_SECS:-8}"
COMPARE_TIMEOUT_SECS="${COMPARE_TIMEOUT_SECS:-60}"
MAX_LIVE_BLOCKS="${MAX_LIVE_BLOCKS:-0}"
IDLE_SECS="${IDLE_SECS:-15}"
DYNAMO_BIND="${DYNAMO_BIND:-127.0.0.1:5561}"
KVRELAY_BIND="${KVRELAY_BIND:-127.0.0.1:5562}"
NATS_PORT="${NATS_PORT:-4222}"
KVRELAY_OPS_BIND="${KVRELAY_OPS_BIND:-127.0.0.1:9464}"
KVRELAY_BIN="${KVRELAY_BIN:-$ROOT/target/release/kvrelay}"
COMPARE_BIN="${COMPARE_BIN:-$ROOT/target/release/kvrelay-compare}"
PY="$DYNLIVE/venv/bin/python"
MODEL="$DYNLIVE/models/tiny-llm"
LOGS="$SBS_DIR/logs"

die() { echo "side-by-side: $*" >&2; exit 2; }

# ---- prerequisites ------------------------------------------------------------------------------
[[ -f "$TOOLS/worker.py" && -f "$TOOLS/env.sh" ]] \
  || die "dynamo-live tools not found at $TOOLS (set DYNAMO_LIVE)"
[[ -x "$PY" ]] || die "no Dynamo venv at $DYNLIVE/venv: run $TOOLS/install.sh first"
"$PY" -c 'import dynamo.llm, dynamo.runtime' 2>/dev/null \
  || die "$PY cannot import dynamo.llm: run $TOOLS/install.sh first"
command -v nats-server >/dev/null || die "nats-server not on PATH: run $TOOLS/install.sh (Debian nats-server)"
[[ -f "$MODEL/config.json" ]] || die "no tiny model at $MODEL: run $TOOLS/install.sh"
[[ -x "$KVRELAY_BIN" ]] || die "no kvrelay binary at $KVRELAY_BIN: run 'cargo build --release -p kvrelay'"
[[ -x "$COMPARE_BIN" ]] || die "no kvrelay-compare binary at $COMPARE_BIN: run 'cargo build --release -p kvrelay'"
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for address in "$DYNAMO_BIND" "$KVRELAY_BIND" "127.0.0.1:$NATS_PORT"; do
  port_free "${address##*:}" || die "port ${address##*:} is already in use (set DYNAMO_BIND / KVRELAY_BIND / NATS_PORT)"
done
CLK_TCK="$(getconf CLK_TCK)"

# ---- process bookkeeping --------------------------------------------------------------------------
declare -A PIDS=()   # name -> pid of everything this script started
stop_one() {
  local name="$1" pid="${PIDS[$1]:-}"
  [[ -n "$pid" ]] || return 0
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  unset "PIDS[$name]"
}
cleanup() {
  local name
  # Workers first (they unregister), then relays, then the event plane.
  for name in "${!PIDS[@]}"; do [[ "$name" == worker-* || "$name" == compare-* ]] && stop_one "$name"; done
  for name in "${!PIDS[@]}"; do [[ "$name" != nats ]] && stop_one "$name"; done
  stop_one nats
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- environment shared by every Dynamo process and kvrelay ---------------------------------------
rm -rf "$SBS_DIR"
mkdir -p "$LOGS" "$SBS_DIR/kvstore" "$SBS_DIR/traces"
export DYN_FILE_KV="$SBS_DIR/kvstore" DYN_DISCOVERY_BACKEND=file
# shellcheck source=/dev/null
source "$TOOLS/env.sh"
export DYN_EVENT_PLANE=nats NATS_SERVER="nats://127.0.0.1:$NATS_PORT"
export DYN_LOG="${DYN_LOG:-info}" RUST_LOG="${RUST_LOG:-info}"

start() {  # start NAME LOG CMD...: run in the background, remember the PID
  local name="$1" log="$2"; shift 2
  "$@" >"$log" 2>&1 &
  PIDS[$name]=$!
}
wait_for_log() {  # wait_for_log NAME LOG PATTERN SECONDS
  local name="$1" log="$2" pattern="$3" seconds="$4"
  for _ in $(seq 1 $((seconds * 5))); do
    grep -q "$pattern" "$log" 2>/dev/null && return 0
    kill -0 "${PIDS[$name]}" 2>/dev/null || { tail -20 "$log" >&2; die "$name exited during start-up (log $log)"; }
    sleep 0.2
  done
  tail -20 "$log" >&2
  die "$name did not log '$pattern' within ${seconds}s (log $log)"
}
POOLS=0   # every worker serves its own endpoint and publishes KV events: one pool each
worker() {  # worker NAME worker.py-args...
  local name="$1"; shift
  POOLS=$((POOLS + 1))
  start "worker-$name" "$LOGS/worker-$name.log" "$PY" "$TOOLS/worker.py" --model-path "$MODEL" "$@"
}

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }     # utime + stime, clock ticks
status_kib() { awk -v key="$2:" '$1 == key { print $2 }' "/proc/$1/status"; }
mib() { awk -v kib="$1" 'BEGIN { printf "%.1f", kib / 1024 }'; }
# kvrelay's share of Dynamo's value ("-" without one).
share() { awk -v k="$1" -v d="$2" 'BEGIN { if (d > 0) printf "%.2fx", k / d; else printf "-" }'; }
worker_events() {  # last stats line of a worker log: "<t seconds> <stored+removed events>"
  grep 'stats: t=' "$1" | tail -1 \
    | sed -E 's/.*t=([0-9.]+)s stored_events=([0-9]+).*removed_events=([0-9]+).*/\1 \2 \3/' \
    | awk '{ print $1, $2 + $3 }'
}

# ---- stack -----------------------------------------------------------------------------------------
start nats "$LOGS/nats.log" nats-server -a 127.0.0.1 -p "$NATS_PORT"
wait_for_log nats "$LOGS/nats.log" "Server is ready" 10
start dynamo "$LOGS/dynamo-relay.log" "$PY" -m dynamo.kv_dc_relay --dc-id dc-a --bind "$DYNAMO_BIND"
# shellcheck disable=SC2086  # KVRELAY_ENV is a list of NAME=VALUE words
start kvrelay "$LOGS/kvrelay.log" env ${KVRELAY_ENV:-} "$KVRELAY_BIN" serve --dc-id dc-a --bind "$KVRELAY_BIND" \
  --ops-bind "$KVRELAY_OPS_BIND"
wait_for_log dynamo "$LOGS/dynamo-relay.log" "KV DC Relay started" 60
wait_for_log kvrelay "$LOGS/kvrelay.log" "relay started" 30
DYNAMO_PID="${PIDS[dynamo]}"; KVRELAY_PID="${PIDS[kvrelay]}"
echo "stack: nats-server :$NATS_PORT, dynamo relay pid $DYNAMO_PID on $DYNAMO_BIND, kvrelay pid $KVRELAY_PID on $KVRELAY_BIND"
echo "       state and logs in $SBS_DIR"
sleep 2
IDLE_DYNAMO_RSS="$(status_kib "$DYNAMO_PID" VmRSS)"; IDLE_KVRELAY_RSS="$(status_kib "$KVRELAY_PID" VmRSS)"

declare -a ROWS=()   # summary rows
OVERALL=0
compare_now() {  # compare_now LABEL: run kvrelay-compare to convergence, record the verdict
  local label="$1" out="$LOGS/compare-$1.txt" rc=0
  "$COMPARE_BIN" --left "$DYNAMO_BIND" --right "$KVRELAY_BIND" --min-pools "$2" \
    --timeout-secs "$COMPARE_TIMEOUT_SECS" --accept-right-load-coverage >"$out" 2>&1 || rc=$?
  sed 's/^/    /' "$out"
  local verdict; verdict="$(grep '^RESULT:' "$out" | tail -1 || true)"
  [[ $rc -eq 0 ]] || OVERALL=1
  COMPARE_RESULTS+=("$label: ${verdict:-kvrelay-compare failed (exit $rc)}")
}
declare -a COMPARE_RESULTS=()

# ---- phase: topology -----------------------------------------------------------------------------
echo
echo "== phase topology: aggregated+LoRA+alias, prefill/decode, DP=2, Eagle, lone prefill; publishing for ${TOPOLOGY_PUBLISH_SECS}s"
common=(--rate 200 --blocks-per-event 4 --publish-seconds "$TOPOLOGY_PUBLISH_SECS" --stats-interval 2)
worker agg --namespace dynamo --component backend --role agg --lora adapter-a,adapter-b \
  --alias tiny-alias --lora-share 0.3 --extend-share 0.3 --max-live-blocks 1500 --seed 1 \
  --trace-out "$SBS_DIR/traces/agg.jsonl" "${common[@]}"
worker prefill --namespace pd --component prefill --role prefill --seed 2 "${common[@]}"
worker decode --namespace pd --component decode --role decode --seed 3 "${common[@]}"
worker dp2 --namespace dp --component backend --role agg --dp-size 2 --seed 4 "${common[@]}"
worker eagle --namespace eagle --component backend --role agg --eagle --seed 5 "${common[@]}"
worker lonely --namespace lonely --component prefill --role prefill --seed 6 "${common[@]}"
for name in agg prefill decode dp2 eagle lonely; do
  wait_for_log "worker-$name" "$LOGS/worker-$name.log" "publishing stopped" $((TOPOLOGY_PUBLISH_SECS + 60))
done
compare_now topology "$POOLS"
TOPO_DYNAMO_RSS="$(status_kib "$DYNAMO_PID" VmRSS)"; TOPO_KVRELAY_RSS="$(status_kib "$KVRELAY_PID" VmRSS)"

# Idle baseline: every topology worker still registered, nothing published, one subscriber.
echo
echo "== idle baseline: ${IDLE_SECS}s with every pool subscribed and no events"
start compare-idle "$LOGS/compare-idle-follow.txt" "$COMPARE_BIN" --left "$DYNAMO_BIND" \
  --right "$KVRELAY_BIND" --min-pools "$POOLS" --stable-checks 1000000 --interval-ms 5000 \
  --timeout-secs $((IDLE_SECS + 30))
sleep 5
d0="$(cpu_ticks "$DYNAMO_PID")"; k0="$(cpu_ticks "$KVRELAY_PID")"
sleep "$IDLE_SECS"
IDLE_DYNAMO_TICKS=$(( $(cpu_ticks "$DYNAMO_PID") - d0 )); IDLE_KVRELAY_TICKS=$(( $(cpu_ticks "$KVRELAY_PID") - k0 ))
stop_one compare-idle
idle_pct() { awk -v t="$1" -v hz="$CLK_TCK" -v w="$IDLE_SECS" 'BEGIN { printf "%.2f", t / hz / w * 100 }'; }
echo "   idle CPU: dynamo $(idle_pct "$IDLE_DYNAMO_TICKS")% kvrelay $(idle_pct "$IDLE_KVRELAY_TICKS")% of one core"

# ---- phases: measured rates ----------------------------------------------------------------------
for rate in $RATES; do
  echo
  echo "== phase rate $rate: stored events/s, 1 block each, max-live-blocks $MAX_LIVE_BLOCKS; warm-up ${WARMUP_SECS}s, window ${MEASURE_SECS}s"
  name="rate$rate"
  publish=$((WARMUP_SECS + MEASURE_SECS + 4))
  worker "$name" --namespace "load$rate" --component backend --role agg --rate "$rate" \
    --blocks-per-event 1 --max-live-blocks "$MAX_LIVE_BLOCKS" --publish-seconds "$publish" \
    --stats-interval 0.5 --seed "$rate"
  wlog="$LOGS/worker-$name.log"
  # One subscriber per relay on every pool while the events flow (kvrelay-compare follows both).
  start "compare-$name" "$LOGS/compare-$name-follow.txt" "$COMPARE_BIN" --left "$DYNAMO_BIND" \
    --right "$KVRELAY_BIND" --min-pools "$POOLS" --stable-checks 1000000 --interval-ms 5000 \
    --timeout-secs $((publish + 30))
  wait_for_log "worker-$name" "$wlog" "stats: t=" 30
  sleep "$WARMUP_SECS"
  read -r w0_t w0_events < <(worker_events "$wlog")
  d0="$(cpu_ticks "$DYNAMO_PID")"; k0="$(cpu_ticks "$KVRELAY_PID")"
  sleep "$MEASURE_SECS"
  read -r w1_t w1_events < <(worker_events "$wlog")
  d1="$(cpu_ticks "$DYNAMO_PID")"; k1="$(cpu_ticks "$KVRELAY_PID")"
  # Events in the CPU window: the worker's own rate between its two counter samples.
  events="$(awk -v e0="$w0_events" -v e1="$w1_events" -v t0="$w0_t" -v t1="$w1_t" -v w="$MEASURE_SECS" \
    'BEGIN { if (t1 <= t0) { print 0 } else { printf "%.0f", (e1 - e0) / (t1 - t0) * w } }')"
  achieved="$(awk -v n="$events" -v w="$MEASURE_SECS" 'BEGIN { printf "%.0f", n / w }')"
  d_rss="$(status_kib "$DYNAMO_PID" VmRSS)"; d_hwm="$(status_kib "$DYNAMO_PID" VmHWM)"
  k_rss="$(status_kib "$KVRELAY_PID" VmRSS)"; k_hwm="$(status_kib "$KVRELAY_PID" VmHWM)"
  row="$(awk -v r="$rate" -v a="$achieved" -v n="$events" -v hz="$CLK_TCK" -v w="$MEASURE_SECS" \
    -v d="$((d1 - d0))" -v k="$((k1 - k0))" -v dr="$d_rss" -v dh="$d_hwm" -v kr="$k_rss" -v kh="$k_hwm" \
    -v di="$IDLE_DYNAMO_TICKS" -v ki="$IDLE_KVRELAY_TICKS" -v iw="$IDLE_SECS" '
    BEGIN {
      dcpu = d / hz; kcpu = k / hz
      dper = n > 0 ? dcpu / n * 1e6 : 0; kper = n > 0 ? kcpu / n * 1e6 : 0
      # marginal: minus the idle baseline scaled to the window
      dm = n > 0 ? (dcpu - di / hz / iw * w) / n * 1e6 : 0; km = n > 0 ? (kcpu - ki / hz / iw * w) / n * 1e6 : 0
      printf "%6d %8d | %6.1f%% %7.2f %7.2f %7.1f %7.1f | %6.1f%% %7.2f %7.2f %7.1f %7.1f | %6s %6s %6s",
        r, a, dcpu / w * 100, dper, dm, dr / 1024, dh / 1024, kcpu / w * 100, kper, km, kr / 1024, kh / 1024,
        (dper > 0 ? sprintf("%.3f", kper / dper) : "-"), (dm > 0 ? sprintf("%.3f", km / dm) : "-"),
        sprintf("%.3f", kr / dr)
    }')"
  ROWS+=("$row")
  echo "   measured: $row"
  # Let the worker stop publishing, then the follower must see both relays agree.
  while kill -0 "${PIDS[compare-$name]}" 2>/dev/null && ! grep -q 'publishing stopped' "$wlog"; do sleep 0.5; done
  stop_one "compare-$name"
  compare_now "$name" "$POOLS"
done

# ---- kvrelay query ----------------------------------------------------------------------------
# (last: every query process is one more subscriber, and each new subscriber's snapshots cost
# the relays memory that is not returned to the OS, which would skew the RSS of the rate phases)
# `kvrelay query` against both relays: prompts taken from the aggregated worker's trace (the
# newest live root chain of the base model and of adapter-a, and the oldest, evicted chain);
# the answers must be equal once the relay-specific producer labels are removed.
echo
echo "== kvrelay query against both relays (prompts from the aggregated worker's trace)"
QUERY_OK=1
while read -r model tokens; do
  for side in dynamo kvrelay; do
    bind="$DYNAMO_BIND"; [[ $side == kvrelay ]] && bind="$KVRELAY_BIND"
    "$KVRELAY_BIN" query --relay "$bind" --model "$model" --tokens "$tokens" --settle-secs 3 2>/dev/null \
      | sed -E 's/ gen=[0-9]+ incarnation=[0-9a-f]+//' >"$LOGS/query-$side.txt" || true
  done
  agg_answer="$(grep -o 'endpoint=dynamo/backend/generate .*' "$LOGS/query-dynamo.txt" | grep -o 'matched=[^ ]*' || echo 'no answer')"
  echo "   $model (tokens ${tokens%%,*}..): $(wc -l <"$LOGS/query-dynamo.txt") pools answer; dynamo/backend/generate $agg_answer"
  if ! diff -q "$LOGS/query-dynamo.txt" "$LOGS/query-kvrelay.txt" >/dev/null || [[ ! -s "$LOGS/query-dynamo.txt" ]]; then
    QUERY_OK=0
    echo "   DIFF: dynamo vs kvrelay"; diff "$LOGS/query-dynamo.txt" "$LOGS/query-kvrelay.txt" | sed 's/^/     /' || true
  fi
done < <("$PY" - "$SBS_DIR/traces/agg.jsonl" <<'PYEOF'
import json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
removed = {h for e in events if e["type"] == "removed" for h in e["block_hashes"]}
roots = [e for e in events if e["type"] == "stored" and e["parent_hash"] is None]
def pick(events, live, lora):
    return [e for e in events if (not set(e["block_hashes"]) & removed) == live and e["lora_name"] == lora]
for model, event in [("tiny-llm", pick(roots, True, None)[-1:]), ("tiny-alias", pick(roots, True, None)[-1:]),
                     ("adapter-a", pick(roots, True, "adapter-a")[-1:]), ("tiny-llm", pick(roots, False, None)[:1])]:
    for e in event:
        print(model, ",".join(map(str, e["token_ids"])))
PYEOF
)
if [[ $QUERY_OK == 1 ]]; then COMPARE_RESULTS+=("query: RESULT: MATCH (kvrelay query answers equal)")
else COMPARE_RESULTS+=("query: RESULT: DIFF (see above)"); OVERALL=1; fi


# ---- summary ---------------------------------------------------------------------------------------
echo
echo "== side-by-side summary (dynamo = python -m dynamo.kv_dc_relay 1.6.1, kvrelay = ${KVRELAY_ENV:+$KVRELAY_ENV }$KVRELAY_BIN serve)"
FINAL_DYNAMO_RSS="$(status_kib "$DYNAMO_PID" VmRSS)"; FINAL_KVRELAY_RSS="$(status_kib "$KVRELAY_PID" VmRSS)"
echo "RSS after the queries: dynamo $(mib "$FINAL_DYNAMO_RSS") MiB, kvrelay $(mib "$FINAL_KVRELAY_RSS") MiB ($(share "$FINAL_KVRELAY_RSS" "$FINAL_DYNAMO_RSS"))"
echo "RSS idle after start-up: dynamo $(mib "$IDLE_DYNAMO_RSS") MiB, kvrelay $(mib "$IDLE_KVRELAY_RSS") MiB ($(share "$IDLE_KVRELAY_RSS" "$IDLE_DYNAMO_RSS"));" \
  "after the topology phase ($((POOLS - $(wc -w <<<"$RATES"))) pools): dynamo $(mib "$TOPO_DYNAMO_RSS") MiB, kvrelay $(mib "$TOPO_KVRELAY_RSS") MiB ($(share "$TOPO_KVRELAY_RSS" "$TOPO_DYNAMO_RSS"))"
for result in "${COMPARE_RESULTS[@]}"; do echo "compare $result"; done
echo
echo "CPU = user+sys of the relay process over the ${MEASURE_SECS}s window: % of one core, µs per event (µs/ev), and"
echo "marginal µs per event after subtracting the idle baseline (marg; idle: dynamo $(idle_pct "$IDLE_DYNAMO_TICKS")%, kvrelay $(idle_pct "$IDLE_KVRELAY_TICKS")%);"
echo "events = stored+removed events the rate worker published in the window; RSS/HWM in MiB at the window's end;"
echo "one subscriber (kvrelay-compare) follows every pool of both relays throughout."
printf '%6s %8s | %7s %7s %7s %7s %7s | %7s %7s %7s %7s %7s | %6s %6s %6s\n' \
  rate achieved "dyn cpu" "µs/ev" "marg" "RSS" "HWM" "kvr cpu" "µs/ev" "marg" "RSS" "HWM" "cpu x" "marg x" "rss x"
for row in "${ROWS[@]}"; do echo "$row"; done
echo "goal (the performance issue): cpu x <= 0.25 and rss x <= 0.40 in every phase (kvrelay / dynamo); $(nproc) CPUs, load average now: $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$OVERALL"
