#!/usr/bin/env bash
# ingest-cpu.sh — what one relay costs per stored event when it follows loadgen's fake Dynamo
# workers over a real NATS server, with a reference consumer subscribed to every pool (the relay's
# whole path: NATS → decode → node → pool → publication → gRPC stream). The relay is
# `kvrelay serve` (RELAY=kvrelay) or NVIDIA Dynamo 1.6.1's `python -m dynamo.kv_dc_relay`
# (RELAY=dynamo), on the same stream: loadgen's output is a function of its seed (the rate).
#
# For each rate in $RATES: start nats-server and the relay (file discovery in a private
# directory), subscribe loadgen's verifier, publish for $WARMUP_SECS + $MEASURE_SECS + 1 s, and
# sample the relay's CPU (user+sys, /proc/PID/stat) over the $MEASURE_SECS window; then the
# verifier checks every live key against loadgen's trace. Prints one table row per rate:
# µs of relay CPU per stored event (and per stored block), peak and final RSS, the NATS client's
# slow-consumer drops, nats-server's count of slow consumers (any client it cut off or dropped
# messages for: the relay, or the verifier), and the verifier's verdict. A fresh relay per rate, so rates do not share
# warm-up or memory. Over the same window it also counts the bytes the workers published into
# NATS (nats-server's /varz `in_bytes`) and the bytes the relay sent on its WAN port (the
# kernel's `bytes_sent` of those sockets, `ss -ti`): the WAN's cost per byte of raw event stream.
#
# With PERF=1 the window is also recorded by `perf record -g` (Debian `linux-perf`) and the top of
# `perf report --no-children` is written next to the logs.
#
# Prerequisites: nats-server on PATH (or /usr/sbin), and release binaries:
#   cargo build --release -p kvrelay -p kvrelay-benches --bin kvrelay --bin loadgen
# and for RELAY=dynamo, ../shared/tools/dynamo-live/install.sh ($DYNLIVE/venv).
#
# Settings (environment):
#   RATES="5000"            stored events/s (loadgen --rate) of each run
#   MEASURE_SECS=20         CPU window;  WARMUP_SECS=3 of publishing before it
#   IDLE_SECS=5             idle CPU window (workers registered, pool subscribed, no events)
#                           before publishing starts; the "net" column subtracts its rate
#   BLOCKS=1 POOLS=1 WORKERS=2 RANKS=1 CHAIN=0.5 LIVE_CAP=50000   loadgen's shape
#   RELAY=kvrelay           kvrelay | dynamo (DYNLIVE=/tmp/dynlive: the venv install.sh made;
#                           DYNAMO_LIVE=../shared/tools/dynamo-live: its env.sh is sourced)
#   KVRELAY_ENV=""          extra NAME=VALUE settings for the relay (e.g. TOKIO_WORKER_THREADS=1)
#   RELAY_LOG=warn          the relay's DYN_LOG (its log is OUT/rate-N/relay.log)
#   TASKSET=""              a CPU list to pin the relay to (e.g. 1), for "on one core"
#   OTHERS_TASKSET=""       a CPU list for nats-server, loadgen and its verifier (e.g. 0)
#   TARGET_DIR=target       where the release binaries are;  OUT=/tmp/kvrelay-ingest  logs
#   NATS_PORT=4232 NATS_MONITOR_PORT=8232 WAN_PORT=5572 OPS_PORT=9474
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RATES="${RATES:-5000}"
MEASURE_SECS="${MEASURE_SECS:-20}"
IDLE_SECS="${IDLE_SECS:-5}"
WARMUP_SECS="${WARMUP_SECS:-3}"
BLOCKS="${BLOCKS:-1}" POOLS="${POOLS:-1}" WORKERS="${WORKERS:-2}" RANKS="${RANKS:-1}"
CHAIN="${CHAIN:-0.5}" LIVE_CAP="${LIVE_CAP:-50000}"
KVRELAY_ENV="${KVRELAY_ENV:-}" TASKSET="${TASKSET:-}" OTHERS_TASKSET="${OTHERS_TASKSET:-}"
RELAY="${RELAY:-kvrelay}" DYNLIVE="${DYNLIVE:-/tmp/dynlive}"
TOOLS="${DYNAMO_LIVE:-$ROOT/../shared/tools/dynamo-live}"
TARGET_DIR="${TARGET_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}}"
OUT="${OUT:-/tmp/kvrelay-ingest}"
NATS_PORT="${NATS_PORT:-4232}" WAN_PORT="${WAN_PORT:-5572}" OPS_PORT="${OPS_PORT:-9474}"
NATS_MONITOR_PORT="${NATS_MONITOR_PORT:-8232}"
KVRELAY="$TARGET_DIR/release/kvrelay"
LOADGEN="$TARGET_DIR/release/loadgen"

die() { echo "ingest-cpu: $*" >&2; exit 2; }
NATS_BIN="$(command -v nats-server || true)"
[[ -z "$NATS_BIN" && -x /usr/sbin/nats-server ]] && NATS_BIN=/usr/sbin/nats-server
[[ -n "$NATS_BIN" ]] || die "no nats-server (apt-get install nats-server)"
[[ -x "$LOADGEN" ]] || die "no $LOADGEN: cargo build --release -p kvrelay-benches --bin loadgen"
case "$RELAY" in
  kvrelay) [[ -x "$KVRELAY" ]] || die "no $KVRELAY: cargo build --release -p kvrelay --bin kvrelay" ;;
  dynamo)
    PY="$DYNLIVE/venv/bin/python"
    [[ -f "$TOOLS/env.sh" ]] || die "no $TOOLS/env.sh (set DYNAMO_LIVE to the dynamo-live tools)"
    "$PY" -c 'import dynamo.llm' 2>/dev/null ||
      die "$PY cannot import dynamo.llm: run ../shared/tools/dynamo-live/install.sh" ;;
  *) die "RELAY is kvrelay or dynamo, not '$RELAY'" ;;
esac
if [[ "${PERF:-0}" == 1 ]]; then command -v perf >/dev/null || die "PERF=1 needs perf (linux-perf)"; fi

declare -A PIDS=()
stop_all() {
  local name pid
  for name in "${!PIDS[@]}"; do
    pid="${PIDS[$name]}"
    kill -TERM "$pid" 2>/dev/null || true
  done
  for name in "${!PIDS[@]}"; do
    pid="${PIDS[$name]}"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
}
trap stop_all EXIT

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
# Context switches of every thread of a process (voluntary + involuntary).
switches() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches:/ { sum += $2 } END { print sum + 0 }'; }
rss_kib() { awk -v key="$2:" '$1 == key { print $2 }' "/proc/$1/status"; }
metric() { curl -fsS -m 3 "http://127.0.0.1:$OPS_PORT/metrics" 2>/dev/null |
  awk -v name="$1" '$1 == name || index($1, name "{") == 1 { sum += $2 } END { printf "%d", sum }'; }
# Bytes published into NATS so far (every client's messages in).
nats_varz() { curl -fsS -m 3 "http://127.0.0.1:$NATS_MONITOR_PORT/varz" 2>/dev/null |
  sed -n "s/.*\"$1\": *\([0-9]*\).*/\1/p" | head -1; }
nats_in_bytes() { nats_varz in_bytes; }
# Bytes the relay's WAN sockets have sent so far (connections open now).
wan_sent_bytes() { ss -tinH state established "( sport = :$WAN_PORT )" 2>/dev/null |
  awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^bytes_sent:/) { split($i, kv, ":"); sum += kv[2] } }
       END { printf "%d", sum }'; }
wait_for() { # SECONDS COMMAND...: poll until COMMAND succeeds
  local seconds="$1"; shift
  for ((i = 0; i < seconds * 10; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

HZ="$(getconf CLK_TCK)"
rm -rf "$OUT"; mkdir -p "$OUT"
echo "| rate asked | achieved | relay µs/event | net of idle | µs/block | CPU % of a core | idle % | context switches/event | inputs/batch | RSS peak / end MiB | WAN B/block | NATS B/block | client drops | NATS slow consumers | verify |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |"
for rate in $RATES; do
  run="$OUT/rate-$rate"; mkdir -p "$run/discovery"
  others=(); [[ -n "$OTHERS_TASKSET" ]] && others=(taskset -c "$OTHERS_TASKSET")
  "${others[@]}" "$NATS_BIN" -a 127.0.0.1 -p "$NATS_PORT" -m "$NATS_MONITOR_PORT" >"$run/nats.log" 2>&1 &
  PIDS[nats]=$!
  wait_for 10 bash -c "exec 3<>/dev/tcp/127.0.0.1/$NATS_PORT" || die "nats-server did not listen"
  pin=(); [[ -n "$TASKSET" ]] && pin=(taskset -c "$TASKSET")
  plane=(DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$run/discovery" DYN_EVENT_PLANE=nats
         NATS_SERVER="nats://127.0.0.1:$NATS_PORT")
  if [[ "$RELAY" == kvrelay ]]; then
    # shellcheck disable=SC2086
    env $KVRELAY_ENV "${plane[@]}" DYN_LOG="${RELAY_LOG:-warn}" \
      "${pin[@]}" "$KVRELAY" serve --dc-id dc-a --bind "127.0.0.1:$WAN_PORT" \
      --ops-bind "127.0.0.1:$OPS_PORT" >"$run/relay.log" 2>&1 &
    PIDS[relay]=$!
    wait_for 30 curl -fsS -m 1 -o /dev/null "http://127.0.0.1:$OPS_PORT/metrics" ||
      die "the relay did not answer /metrics (log $run/relay.log)"
  else
    # Dynamo's environment from the dynamo-live tools (loopback request plane, offline
    # tokenizers), then this run's planes, and log level "info": its start-up line is how we
    # know it listens.
    (
      export DYN_FILE_KV="$run/discovery"
      # shellcheck source=/dev/null
      source "$TOOLS/env.sh"
      exec env "${plane[@]}" DYN_LOG=info "${pin[@]}" "$PY" -m dynamo.kv_dc_relay \
        --dc-id dc-a --bind "127.0.0.1:$WAN_PORT"
    ) >"$run/relay.log" 2>&1 &
    PIDS[relay]=$!
    wait_for 60 grep -q "KV DC Relay started" "$run/relay.log" ||
      die "Dynamo's relay did not start (log $run/relay.log)"
  fi
  relay="${PIDS[relay]}"
  duration=$((WARMUP_SECS + MEASURE_SECS + 1))
  "${others[@]}" "$LOADGEN" --verify-only --verify "127.0.0.1:$WAN_PORT" --trace "$run/trace.json" \
    --trace-wait-secs $((duration + 60)) >"$run/verify.out" 2>"$run/verify.err" &
  PIDS[verify]=$!
  "${others[@]}" "$LOADGEN" --nats "nats://127.0.0.1:$NATS_PORT" --discovery-dir "$run/discovery" \
    --pools "$POOLS" --workers-per-pool "$WORKERS" --ranks "$RANKS" --rate "$rate" \
    --blocks-per-event "$BLOCKS" --chain-share "$CHAIN" --live-cap "$LIVE_CAP" \
    --duration-secs "$duration" --warmup-ms $(((IDLE_SECS + 3) * 1000)) --trace "$run/trace.json" \
    --linger-secs 300 --seed "$rate" >"$run/loadgen.out" 2>"$run/loadgen.err" &
  PIDS[loadgen]=$!
  wait_for 30 grep -q 'warming up' "$run/loadgen.err" || die "loadgen did not register ($run/loadgen.err)"
  # Idle: 2 s for the pool to start and the verifier to subscribe, then IDLE_SECS measured.
  sleep 2
  idle_before="$(cpu_ticks "$relay")"; i0="$EPOCHREALTIME"
  sleep "$IDLE_SECS"
  idle_after="$(cpu_ticks "$relay")"; i1="$EPOCHREALTIME"
  sleep $((1 + WARMUP_SECS))
  if [[ "${PERF:-0}" == 1 ]]; then
    perf record -g -o "$run/perf.data" -p "$relay" -- sleep "$MEASURE_SECS" >"$run/perf.log" 2>&1 &
    PIDS[perf]=$!
  fi
  nats_before="$(nats_in_bytes)"; wan_before="$(wan_sent_bytes)"
  before="$(cpu_ticks "$relay")"; cs_before="$(switches "$relay")"; t0="$EPOCHREALTIME"
  sleep "$MEASURE_SECS"
  after="$(cpu_ticks "$relay")"; cs_after="$(switches "$relay")"; t1="$EPOCHREALTIME"
  nats_after="$(nats_in_bytes)"; wan_after="$(wan_sent_bytes)"
  # The relay's metrics at the window's end, kept for reading afterwards.
  curl -fsS -m 3 "http://127.0.0.1:$OPS_PORT/metrics" >"$run/metrics.txt" 2>/dev/null || true
  # loadgen keeps its workers registered (--linger-secs) until the verifier is done.
  wait_for 60 grep -q 'done:' "$run/loadgen.err" || echo "ingest-cpu: loadgen did not finish ($run/loadgen.err)" >&2
  achieved="$(sed -n 's/.* = \([0-9.]*\)\/s (asked.*/\1/p' "$run/loadgen.err")"
  verdict=failed
  if wait "${PIDS[verify]}"; then verdict=ok; fi
  unset 'PIDS[verify]'
  kill -TERM "${PIDS[loadgen]}" 2>/dev/null || true
  wait "${PIDS[loadgen]}" 2>/dev/null || true
  unset 'PIDS[loadgen]'
  if [[ -n "${PIDS[perf]:-}" ]]; then
    wait "${PIDS[perf]}" || true
    unset 'PIDS[perf]'
    perf report -i "$run/perf.data" --no-children --percent-limit 0.7 --stdio 2>/dev/null |
      grep -v '^$' | head -400 >"$run/perf-report.txt" || true
  fi
  # The relay's own count of messages its NATS client dropped, and DC inputs per wake-up of the
  # node over the whole run (kvrelay only; "-" for Dynamo's relay, which reports neither).
  drops=-; inputs=0; batches=0
  if [[ "$RELAY" == kvrelay ]]; then
    drops="$(metric kvrelay_event_plane_client_drops_total)"
    inputs="$(metric kvrelay_dc_inputs_total)"; batches="$(metric kvrelay_dc_input_batches_total)"
  fi
  slow="$(nats_varz slow_consumers)"
  hwm="$(rss_kib "$relay" VmHWM)"; rss="$(rss_kib "$relay" VmRSS)"
  awk -v b="$before" -v a="$after" -v t0="$t0" -v t1="$t1" -v hz="$HZ" -v rate="$rate" \
    -v ach="${achieved:-0}" -v blocks="$BLOCKS" -v hwm="$hwm" -v rss="$rss" -v drops="$drops" -v slow="${slow:--}" \
    -v verdict="$verdict" -v cs="$((cs_after - cs_before))" -v inputs="$inputs" -v batches="$batches" \
    -v idle="$((idle_after - idle_before))" -v i0="$i0" -v i1="$i1" \
    -v nats="$(( ${nats_after:-0} - ${nats_before:-0} ))" -v wan="$(( ${wan_after:-0} - ${wan_before:-0} ))" 'BEGIN {
      cpu = (a - b) / hz; wall = t1 - t0; events = ach * wall
      idle_rate = (idle / hz) / (i1 - i0)
      per = events > 0 ? cpu * 1e6 / events : 0
      net = events > 0 ? (cpu - idle_rate * wall) * 1e6 / events : 0
      per_batch = batches > 0 ? sprintf("%.2f", inputs / batches) : "-"
      stored = events * blocks
      printf "| %d | %.1f | %.2f | %.2f | %.2f | %.1f | %.2f | %.2f | %s | %.0f / %.0f | %.1f | %.1f | %s | %s | %s |\n",
        rate, ach, per, net, per / blocks, 100 * cpu / wall, 100 * idle_rate,
        (events > 0 ? cs / events : 0), per_batch, hwm / 1024, rss / 1024,
        (stored > 0 ? wan / stored : 0), (stored > 0 ? nats / stored : 0), drops, slow, verdict }'
  stop_all
done
echo
echo "shape: $POOLS pool(s) x $WORKERS workers x $RANKS rank(s), $BLOCKS block(s)/event, chain $CHAIN, live cap $LIVE_CAP; window ${MEASURE_SECS}s after ${WARMUP_SECS}s, idle ${IDLE_SECS}s; relay: $RELAY, env: ${KVRELAY_ENV:-none}${TASKSET:+, taskset $TASKSET}; logs in $OUT"
