#!/usr/bin/env bash
# chaos.sh — real-process fault injection for `kvrelay serve`, beside the simulator's scenarios.
#
# The simulator (`sim/`, scenarios/) injects faults into the relay's own code on a simulated
# network. This script injects the same kinds of faults into real processes on real sockets:
#
#   namespace <prefix>-dc     nats-server, etcd, and loadgen's fake Dynamo workers   10.77.1.1
#        | veth dc0 <-> dc1
#   namespace <prefix>-relay  the built `kvrelay serve` (debug)       10.77.1.2 / 10.77.2.1
#        | veth wan1 <-> wan0
#   namespace <prefix>-wan    the consumer: loadgen's verifier                       10.77.2.2
#
# All three namespaces, both veth pairs and every address are private to this machine. Each
# phase is one loadgen run (its own Dynamo namespace and seed) with one fault injected while it
# publishes:
#
#   1. a follower verifier (`loadgen --verify-only --trace-wait-secs`) subscribes in the WAN
#      namespace and follows the relay through the whole phase;
#   2. loadgen registers its workers in etcd, warms up, publishes for PRE_SECS;
#   3. the fault is injected, held, and repaired ("repair" is when the script undoes it);
#   4. loadgen keeps publishing for the phase's post-repair time, writes its trace (what it
#      published: the live and removed block keys) and lingers registered;
#   5. the follower checks the trace (exit 0: no false negatives, no removed keys present
#      beyond the filter's false-positive bound); if it fails, fresh verifiers are run, a bounded
#      number of times, until one passes.
#
# Time to converge = from repair until the first passing verifier exits. The trace exists only
# once loadgen stops publishing, so this includes the phase's post-repair publishing time (shown
# in the table) and the verifier's 1 s quiet wait: an upper bound.
#
# loadgen's workers are live-only (no local indexer), as Dynamo workers without one are: a
# relay that misses events of a rank (it was down, or NATS was) resets the rank at the gap and
# cannot recover the earlier blocks. Faults that lose events by nature (relay kill, NATS
# restart) therefore publish long enough after repair for every rank's live set to turn over
# ("lossy" phases, small live cap); the other faults must lose nothing (a partition shorter than
# the NATS client's 60 s ping only delays TCP), and their live cap keeps blocks stored before and
# during the fault live until the end ("strict").
#
# Table columns: survived = a verifier passed within the bounded attempts; converge s = repair
# to the first passing verifier's exit; ready s = repair to the relay's /ready answering 200;
# events s = repair to the relay routing a KV event batch to its pools again; follower = whether
# the verifier that followed the relay through the fault passed (else how many fresh ones ran).
#
# Needs: root, iproute2 (`ip`), nats-server, etcd, and the debug binaries
#   CARGO_TARGET_DIR=/work/target-loadgen cargo build -p kvrelay --bin kvrelay
#   CARGO_TARGET_DIR=/work/target-loadgen cargo build -p kvrelay-benches --bin loadgen
# Link impairments use `tc netem` (and `htb` for the throttle) when the kernel has sch_netem.
# Without it, the two links become TUN devices carried by scripts/tun-link.py (python3,
# /dev/net/tun): one process per link forwards every IP packet between the namespaces and, on a
# fault, drops, loses, delays, reorders (25 % of packets skip a 20 ms hold and overtake the
# others: real out-of-order segments) or throttles them, as netem would (`--link tun` forces this,
# `--link veth` forbids it). Without either, loss and partitions use nftables (`nft`, netdev
# ingress drops on both ends of the link) and delay and reordering use scripts/delay-proxy.py:
# the relay reaches NATS and etcd, and the verifiers reach the relay, through TCP forwarders that
# hold chunks of the byte stream (reordering then shows only as TCP's head-of-line blocking).
#
# Everything is bounded: each wait has a bound and the whole run a deadline. On exit, error or
# Ctrl-C it stops every process it started (by PID), deletes its namespaces (and with them the
# veths and any impairment) and its temporary directory.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<'EOF'
Usage: scripts/chaos.sh [--quick] [--out FILE] [options]

Real-process fault injection: nats-server + etcd + loadgen workers in one network namespace,
`kvrelay serve` in a second, the verifier in a third; faults one at a time, each followed by a
convergence check with loadgen's verifier. Prints a table (fault, survived, time to converge).

  --quick            baseline, relay kill -9 and a DC partition (under 3 minutes)
  (default: full)    baseline, relay kill -9, relay kill -9 and restart inside a DC partition,
                     NATS restart, etcd restart, DC partition, DC link down, WAN partition
                     (longer than the relay's keepalive), WAN throttled, loss, delay, reordering
  --only F1,F2       run only these faults (names as in the table), in the given order
  --out FILE         also write the table (markdown) to FILE
  --keep-logs DIR    copy every log of the run into DIR before cleaning up
  --target-dir DIR   where the debug binaries are (default $CARGO_TARGET_DIR, else
                     /work/target-loadgen if it has them, else ./target)
  --prefix NAME      namespace prefix (default kvr: kvr-dc, kvr-relay, kvr-wan)
  --subnet A.B       first two octets of the private /24s (default 10.77: 10.77.1.0/24 DC link,
                     10.77.2.0/24 WAN link)
  --rate N           stored events/s of loadgen (default 300)
  --link KIND        auto (default: veth with sch_netem, else TUN links if python3 and
                     /dev/net/tun exist), veth, or tun (packets carried by scripts/tun-link.py)
  -h, --help         this text

Faults: baseline relay-kill relay-kill-partitioned nats-restart etcd-restart dc-partition
        dc-link-down wan-partition wan-throttle loss delay reorder
Exit: 0 every fault survived, 1 some did not, 2 a prerequisite is missing, 3 the stack failed
(start-up, deadline), 130 interrupted.
EOF
}

# ---- options ------------------------------------------------------------------------------------
MODE=full
ONLY=""
OUT=""
KEEP_LOGS=""
TARGET_DIR="${CARGO_TARGET_DIR:-}"
PREFIX=kvr
SUBNET=10.77
RATE=300
LINK=auto
while (($#)); do
  case "$1" in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    --only) ONLY="${2:?--only needs a list}"; shift ;;
    --out) OUT="${2:?--out needs a file}"; shift ;;
    --keep-logs) KEEP_LOGS="${2:?--keep-logs needs a directory}"; shift ;;
    --target-dir) TARGET_DIR="${2:?--target-dir needs a directory}"; shift ;;
    --prefix) PREFIX="${2:?--prefix needs a name}"; shift ;;
    --subnet) SUBNET="${2:?--subnet needs A.B}"; shift ;;
    --rate) RATE="${2:?--rate needs a number}"; shift ;;
    --link) LINK="${2:?--link needs auto, veth or tun}"; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "chaos: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

die() { echo "chaos: $*" >&2; exit 2; }

# ---- prerequisites ------------------------------------------------------------------------------
[[ "$(id -u)" == 0 ]] || die "must run as root (it creates network namespaces and veth pairs)"
command -v ip >/dev/null || die "'ip' (iproute2) is missing: apt-get install iproute2"
command -v nats-server >/dev/null || die "nats-server is missing: apt-get install nats-server"
command -v etcd >/dev/null || die "etcd is missing: apt-get install etcd-server"
command -v curl >/dev/null || die "curl is missing: apt-get install curl"
command -v timeout >/dev/null || die "timeout (coreutils) is missing"
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "--prefix must be 1-8 lowercase letters/digits"
[[ "$SUBNET" =~ ^(10\.[0-9]{1,3}|192\.168)$ ]] || die "--subnet must be 10.N or 192.168"
if ! [[ "$RATE" =~ ^[0-9]+$ ]] || ((RATE < 50 || RATE > 2000)); then die "--rate must be 50..2000"; fi
[[ "$LINK" =~ ^(auto|veth|tun)$ ]] || die "--link must be auto, veth or tun"
if [[ "$LINK" == tun ]]; then
  command -v python3 >/dev/null || die "--link tun needs python3"
  [[ -c /dev/net/tun ]] || die "--link tun needs /dev/net/tun"
fi
if [[ -z "$TARGET_DIR" ]]; then
  if [[ -x /work/target-loadgen/debug/loadgen ]]; then TARGET_DIR=/work/target-loadgen; else TARGET_DIR="$ROOT/target"; fi
fi
KVRELAY="$TARGET_DIR/debug/kvrelay"
LOADGEN="$TARGET_DIR/debug/loadgen"
[[ -x "$KVRELAY" ]] || die "no $KVRELAY: cargo build -p kvrelay --bin kvrelay (CARGO_TARGET_DIR=$TARGET_DIR)"
[[ -x "$LOADGEN" ]] || die "no $LOADGEN: cargo build -p kvrelay-benches --bin loadgen (CARGO_TARGET_DIR=$TARGET_DIR)"
"$LOADGEN" --help 2>/dev/null | grep -q -- --trace-wait-secs \
  || die "$LOADGEN has no --trace-wait-secs: rebuild it from this tree"

ALL_FAULTS=(baseline relay-kill relay-kill-partitioned nats-restart etcd-restart dc-partition
  dc-link-down wan-partition wan-throttle loss delay reorder)
if [[ -n "$ONLY" ]]; then
  MODE=custom
  IFS=, read -r -a FAULTS <<<"$ONLY"
  for fault in "${FAULTS[@]}"; do
    [[ " ${ALL_FAULTS[*]} " == *" $fault "* ]] || die "unknown fault '$fault' (faults: ${ALL_FAULTS[*]})"
  done
elif [[ "$MODE" == quick ]]; then
  FAULTS=(baseline relay-kill dc-partition)
else
  FAULTS=("${ALL_FAULTS[@]}")
fi
# The whole run's deadline: generous for each phase's ~25 s on a loaded 2-core machine.
if [[ "$MODE" == quick && -z "$ONLY" ]]; then DEADLINE_SECS=175; else DEADLINE_SECS=$((60 + 75 * ${#FAULTS[@]})); fi

NS_DC="$PREFIX-dc" NS_RELAY="$PREFIX-relay" NS_WAN="$PREFIX-wan"
for ns in "$NS_DC" "$NS_RELAY" "$NS_WAN"; do
  [[ ! -e "/run/netns/$ns" ]] \
    || die "network namespace $ns already exists: another run (use --prefix), or left by a run killed with SIGKILL (ip netns del $ns)"
done
DC_IP="$SUBNET.1.1" RELAY_DC_IP="$SUBNET.1.2" RELAY_WAN_IP="$SUBNET.2.1" WAN_IP="$SUBNET.2.2"
NATS_URL="nats://$DC_IP:4222"
ETCD_URL="http://$DC_IP:2379"
RELAY_ADDR="$RELAY_WAN_IP:5562"
OPS_URL="http://127.0.0.1:9090"   # the relay namespace's own loopback

# ---- the run's state ------------------------------------------------------------------------------
START="$EPOCHREALTIME"
WORK="$(mktemp -d /tmp/kvrelay-chaos.XXXXXX)"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
declare -A PIDS=()          # name -> PID of every process this script started and not yet reaped
CREATED_NS=()               # namespaces this script created (deleted on exit)
RELAY_STARTS=0
NATS_STARTS=0
ETCD_STARTS=0
IMPAIR=none                 # netem | tun | nft | none (how loss and partitions are made)
DELAY=none                  # netem | tun | proxy | none (how delay and reordering are made)
RELAY_NATS_URL="$NATS_URL"  # what the relay connects to (a forwarder's address with DELAY=proxy)
RELAY_ETCD_URL="$ETCD_URL"
VERIFY_ADDR="$RELAY_ADDR"   # what the verifiers connect to
HTB=no                      # whether the kernel has the htb qdisc (the throttle)
ROWS=()                     # table rows, markdown
FAILED=0

t() { awk -v a="$START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
diff_secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
log() { echo "[chaos +$(t)s] $*" >&2; }

past_deadline() { awk -v a="$START" -v b="$EPOCHREALTIME" -v d="$DEADLINE_SECS" 'BEGIN { exit !(b - a > d) }'; }
check_deadline() {
  if past_deadline; then
    log "the run's deadline of ${DEADLINE_SECS}s has passed: stopping"
    exit 3
  fi
}

# Start NAME in namespace NS with its output in LOG; remember its PID. `ip netns exec` execs the
# command, so the PID is the command's own.
start_in() {
  local ns="$1" name="$2" out="$3"
  shift 3
  ip netns exec "$ns" "$@" >"$out" 2>&1 </dev/null &
  PIDS[$name]=$!
}
alive() { [[ -n "${PIDS[$1]:-}" ]] && kill -0 "${PIDS[$1]}" 2>/dev/null; }
# Stop NAME by its PID: SIGNAL (default TERM), then KILL after BOUND seconds (default 5); reap it.
# (stderr off throughout: bash reports a background job killed by a signal when it notices.)
stop() {
  local name="$1" signal="${2:-TERM}" bound="${3:-5}" pid="${PIDS[$1]:-}" i
  [[ -n "$pid" ]] || return 0
  {
    kill -"$signal" "$pid"
    for ((i = 0; i < bound * 10; i++)); do kill -0 "$pid" || break; sleep 0.1; done
    kill -0 "$pid" && kill -KILL "$pid"
    wait "$pid"
  } 2>/dev/null
  unset "PIDS[$name]"
}
# Wait until NAME exits (at most BOUND seconds); sets EXITED to its exit status, or "running".
# Calls watch_relay while it waits. (Not a command substitution: `wait` must run in the shell
# that started the process.)
EXITED=""
wait_exit() {
  local name="$1" bound="$2" pid="${PIDS[$1]:-}" end
  EXITED=gone
  [[ -n "$pid" ]] || return 0
  EXITED=running
  end="$(awk -v a="$EPOCHREALTIME" -v b="$bound" 'BEGIN { printf "%.6f", a + b }')"
  while awk -v a="$EPOCHREALTIME" -v e="$end" 'BEGIN { exit !(a < e) }'; do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null
      EXITED=$?
      unset "PIDS[$name]"
      return 0
    fi
    past_deadline && break
    watch_relay
    sleep 0.2
  done
}

# shellcheck disable=SC2317  # reached through the EXIT trap
cleanup() {
  local status=$? name pid ns
  trap - EXIT INT TERM
  # Consumers and workers first (workers unregister on SIGTERM), then the relay, then the planes.
  for name in "${!PIDS[@]}"; do [[ "$name" == verify* || "$name" == loadgen* ]] && stop "$name" TERM 5; done
  for name in relay nats etcd; do stop "$name" TERM 10; done
  for name in "${!PIDS[@]}"; do stop "$name" TERM 5; done
  # Anything still inside our namespaces was started by this script (through the commands
  # above): end it by PID before the namespace goes.
  for ns in "${CREATED_NS[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  done
  for ns in "${CREATED_NS[@]}"; do ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"; done
  if [[ -n "$KEEP_LOGS" ]]; then
    mkdir -p "$KEEP_LOGS" && cp -r "$LOGS"/. "$KEEP_LOGS"/ && log "logs kept in $KEEP_LOGS"
  fi
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# ---- network ---------------------------------------------------------------------------------------
# Every link's two ends: "namespace device".
DC_ENDS=("$NS_DC dc0" "$NS_RELAY dc1")
WAN_ENDS=("$NS_RELAY wan1" "$NS_WAN wan0")

make_network() {
  local ns
  for ns in "$NS_DC" "$NS_RELAY" "$NS_WAN"; do
    ip netns add "$ns" || exit 3
    CREATED_NS+=("$ns")
    ip -n "$ns" link set lo up
  done
  ip link add dc0 netns "$NS_DC" type veth peer name dc1 netns "$NS_RELAY" || exit 3
  ip link add wan1 netns "$NS_RELAY" type veth peer name wan0 netns "$NS_WAN" || exit 3
  # How impairments are made on this kernel.
  if [[ "$LINK" != tun ]] && command -v tc >/dev/null \
    && ip netns exec "$NS_RELAY" tc qdisc add dev dc1 root netem delay 1ms 2>/dev/null; then
    ip netns exec "$NS_RELAY" tc qdisc del dev dc1 root
    IMPAIR=netem
  elif [[ "$LINK" == tun || ("$LINK" == auto && -c /dev/net/tun) ]] && command -v python3 >/dev/null; then
    # Deleting one end of a veth pair deletes both.
    ip -n "$NS_DC" link del dc0 && ip -n "$NS_RELAY" link del wan1 || exit 3
    local end
    for end in "${DC_ENDS[@]}" "${WAN_ENDS[@]}"; do
      read -r ns dev <<<"$end"
      ip -n "$ns" tuntap add dev "$dev" mode tun || exit 3
    done
    IMPAIR=tun
  elif command -v nft >/dev/null; then
    IMPAIR=nft
  fi
  ip -n "$NS_DC" addr add "$DC_IP/24" dev dc0
  ip -n "$NS_RELAY" addr add "$RELAY_DC_IP/24" dev dc1
  ip -n "$NS_RELAY" addr add "$RELAY_WAN_IP/24" dev wan1
  ip -n "$NS_WAN" addr add "$WAN_IP/24" dev wan0
  ip -n "$NS_DC" link set dc0 up
  ip -n "$NS_RELAY" link set dc1 up
  ip -n "$NS_RELAY" link set wan1 up
  ip -n "$NS_WAN" link set wan0 up
  if [[ "$IMPAIR" == netem || "$IMPAIR" == tun ]]; then
    DELAY="$IMPAIR"
  elif [[ " ${FAULTS[*]} " == *" delay "* || " ${FAULTS[*]} " == *" reorder "* ]] && command -v python3 >/dev/null; then
    DELAY=proxy
  fi
  if [[ "$IMPAIR" == tun ]]; then
    start_tun_link dc "${DC_ENDS[@]}"
    start_tun_link wan "${WAN_ENDS[@]}"
  elif command -v tc >/dev/null && ip netns exec "$NS_RELAY" tc qdisc add dev wan1 root handle 1: htb 2>/dev/null; then
    ip netns exec "$NS_RELAY" tc qdisc del dev wan1 root
    HTB=yes
  fi
  log "namespaces $NS_DC ($DC_IP) - $NS_RELAY ($RELAY_DC_IP, $RELAY_WAN_IP) - $NS_WAN ($WAN_IP); impairments: $IMPAIR, delay: $DELAY"
}

# start_tun_link LINK "NS DEV" "NS DEV": the process carrying LINK's packets (a = the first end),
# impaired through its control file $WORK/link-LINK.ctl. It enters both namespaces itself.
start_tun_link() {
  local link="$1" ns_a dev_a ns_b dev_b seed=11
  read -r ns_a dev_a <<<"$2"
  read -r ns_b dev_b <<<"$3"
  [[ "$link" == wan ]] && seed=12
  echo "both pass" >"$WORK/link-$link.ctl"
  python3 "$ROOT/scripts/tun-link.py" --a "$ns_a:$dev_a" --b "$ns_b:$dev_b" \
    --control "$WORK/link-$link.ctl" --seed "$seed" >"$LOGS/link-$link.log" 2>&1 </dev/null &
  PIDS[link-$link]=$!
  local i
  for ((i = 0; i < 50; i++)); do
    grep -q " up$" "$LOGS/link-$link.log" 2>/dev/null && return 0
    alive "link-$link" || break
    sleep 0.1
  done
  log "the $link link did not come up: $(tail -n 3 "$LOGS/link-$link.log")"
  exit 3
}
# tun_mode LINK SPEC: set LINK's impairment (a line of scripts/tun-link.py's control file, e.g.
# "both loss 10", "a2b rate 1000"); `a` is the relay side of the WAN link, the DC side of the DC
# link.
tun_mode() {
  local link="$1"
  alive "link-$link" || return 1
  echo "$2" >"$WORK/link-$link.ctl"
  kill -HUP "${PIDS[link-$link]}"
}

# With DELAY=proxy: the forwarders, and the addresses the relay and the verifiers use through them.
PROXIES=(proxy-nats proxy-etcd proxy-wan)
start_proxies() {
  local proxy="$ROOT/scripts/delay-proxy.py"
  start_in "$NS_RELAY" proxy-nats "$LOGS/proxy-nats.log" python3 "$proxy" \
    --listen 127.0.0.1:14222 --upstream "$DC_IP:4222" --seed 1
  start_in "$NS_RELAY" proxy-etcd "$LOGS/proxy-etcd.log" python3 "$proxy" \
    --listen 127.0.0.1:12379 --upstream "$DC_IP:2379" --seed 2
  start_in "$NS_WAN" proxy-wan "$LOGS/proxy-wan.log" python3 "$proxy" \
    --listen 127.0.0.1:15562 --upstream "$RELAY_ADDR" --seed 3
  wait_port "$NS_RELAY" 127.0.0.1 14222 10 proxy-nats || exit 3
  wait_port "$NS_RELAY" 127.0.0.1 12379 10 proxy-etcd || exit 3
  wait_port "$NS_WAN" 127.0.0.1 15562 10 proxy-wan || exit 3
  RELAY_NATS_URL="nats://127.0.0.1:14222" RELAY_ETCD_URL="http://127.0.0.1:12379"
  VERIFY_ADDR="127.0.0.1:15562"
}
# signal_proxies SIGNAL: USR1 delay, HUP reordering, USR2 straight through.
signal_proxies() {
  local name
  for name in "${PROXIES[@]}"; do alive "$name" && kill -"$1" "${PIDS[$name]}"; done
  return 0
}

# impair LINK KIND [PERCENT]: KIND = drop (everything), loss (PERCENT %), or a netem spec
# ("netem delay 50ms 10ms"). Applied on both ends of the link, so both directions suffer.
impair() {
  local link="$1" kind="$2" percent="${3:-100}" ends end ns dev rule spec
  if [[ "$link" == dc ]]; then ends=("${DC_ENDS[@]}"); else ends=("${WAN_ENDS[@]}"); fi
  for end in "${ends[@]}"; do
    read -r ns dev <<<"$end"
    case "$IMPAIR:$kind" in
      tun:drop | tun:loss) ;;
      netem:drop) ip netns exec "$ns" tc qdisc replace dev "$dev" root netem loss 100% ;;
      netem:loss) ip netns exec "$ns" tc qdisc replace dev "$dev" root netem loss "$percent%" ;;
      netem:netem*)
        read -r -a spec <<<"$kind"
        ip netns exec "$ns" tc qdisc replace dev "$dev" root "${spec[@]}" ;;
      nft:drop | nft:loss)
        if [[ "$kind" == drop ]]; then rule="drop"; else rule="numgen random mod 100 < $percent drop"; fi
        # netdev ingress: the packet is lost on arrival, its sender sees nothing (as on a wire).
        ip netns exec "$ns" nft -f - <<EOF
table netdev kvrchaos {
  chain ingress_$dev {
    type filter hook ingress device "$dev" priority 0; policy accept;
    $rule
  }
}
EOF
        ;;
      *) return 1 ;;
    esac
  done
  if [[ "$IMPAIR" == tun ]]; then
    if [[ "$kind" == drop ]]; then tun_mode "$link" "both drop"; else tun_mode "$link" "both loss $percent"; fi
  fi
}
clear_impairments() {
  local end ns dev
  [[ "$DELAY" == proxy ]] && signal_proxies USR2
  if [[ "$IMPAIR" == tun ]]; then tun_mode dc "both pass"; tun_mode wan "both pass"; fi
  for end in "${DC_ENDS[@]}" "${WAN_ENDS[@]}"; do
    read -r ns dev <<<"$end"
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null
    command -v nft >/dev/null && ip netns exec "$ns" nft delete table netdev kvrchaos 2>/dev/null
    ip -n "$ns" link set "$dev" up
  done
  return 0
}

# ---- the stack -------------------------------------------------------------------------------------
start_nats() {
  NATS_STARTS=$((NATS_STARTS + 1))
  start_in "$NS_DC" nats "$LOGS/nats-$NATS_STARTS.log" nats-server -a "$DC_IP" -p 4222
}
start_etcd() {
  ETCD_STARTS=$((ETCD_STARTS + 1))
  # The same data directory on every start: a restart keeps the records, the revisions and the
  # leases (etcd renews a lease's TTL when it starts).
  start_in "$NS_DC" etcd "$LOGS/etcd-$ETCD_STARTS.log" etcd --name chaos --data-dir "$WORK/etcd" \
    --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster chaos=http://127.0.0.1:2380
}
start_relay() {
  RELAY_STARTS=$((RELAY_STARTS + 1))
  start_in "$NS_RELAY" relay "$LOGS/relay-$RELAY_STARTS.log" env \
    DYN_DISCOVERY_BACKEND=etcd ETCD_ENDPOINTS="$RELAY_ETCD_URL" \
    DYN_EVENT_PLANE=nats NATS_SERVER="$RELAY_NATS_URL" DYN_LOG=info \
    "$KVRELAY" serve --dc-id dc-chaos --bind "$RELAY_ADDR" --ops-bind 127.0.0.1:9090
}
# wait_port NS HOST PORT SECONDS NAME: a TCP connect succeeds.
wait_port() {
  local ns="$1" host="$2" port="$3" seconds="$4" name="$5" i
  for ((i = 0; i < seconds * 5; i++)); do
    ip netns exec "$ns" timeout 1 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null && return 0
    alive "$name" || { log "$name exited during start-up"; return 1; }
    sleep 0.2
  done
  log "$name did not listen on $host:$port within ${seconds}s"
  return 1
}
relay_ready() { ip netns exec "$NS_RELAY" curl -fsS -m 2 -o /dev/null "$OPS_URL/ready" 2>/dev/null; }
# wait_ready SECONDS: the relay answers /ready with 200.
wait_ready() {
  local seconds="$1" i
  for ((i = 0; i < seconds * 4; i++)); do
    relay_ready && return 0
    alive relay || { log "the relay exited (log $LOGS/relay-$RELAY_STARTS.log)"; return 1; }
    sleep 0.25
  done
  log "the relay was not ready within ${seconds}s"
  return 1
}
metrics() { ip netns exec "$NS_RELAY" curl -fsS -m 3 "$OPS_URL/metrics" 2>/dev/null; }
# KV event batches the relay has routed to its pools, a per-process counter (0 while /metrics
# does not answer).
routed_batches() {
  local value
  value="$(metrics | awk '$1 == "kvrelay_control_kv_batches_routed_total" { printf "%d", $2 }')"
  echo "${value:-0}"
}
# After a repair: note when the relay is first ready and first routes a KV event again.
ROUTED_AT_REPAIR=0
T_READY=""
T_EVENTS=""
watch_relay() {
  local routed
  if [[ -z "$T_READY" ]] && relay_ready; then T_READY="$EPOCHREALTIME"; fi
  if [[ -z "$T_EVENTS" ]]; then
    routed="$(routed_batches)"
    # A restarted relay counts from zero.
    if ((routed > ROUTED_AT_REPAIR || (routed > 0 && routed < ROUTED_AT_REPAIR))); then
      T_EVENTS="$EPOCHREALTIME"
    fi
  fi
}
# metric FILE NAME: the sum of a metric family's samples in a /metrics dump (0 when absent).
metric() { awk -v name="$2" '$1 == name || index($1, name "{") == 1 { sum += $2 } END { printf "%d", sum }' "$1"; }

start_stack() {
  start_etcd
  wait_port "$NS_DC" "$DC_IP" 2379 20 etcd || exit 3
  start_nats
  wait_port "$NS_DC" "$DC_IP" 4222 10 nats || exit 3
  [[ "$DELAY" == proxy ]] && start_proxies
  start_relay
  wait_ready 60 || exit 3
  log "stack up: etcd, nats-server, kvrelay serve (pid ${PIDS[relay]}) ready at $RELAY_ADDR"
}

# ---- phases ----------------------------------------------------------------------------------------
# Loadgen's shape: 2 pools x 2 workers x 1 rank, 4 blocks per stored event, RATE stored events/s
# in total, so each rank stores RATE blocks/s and its live set (oldest removed above the live
# cap) holds the last live_cap / RATE seconds of blocks. A lossy phase's cap is 3 s (turned over
# well within its post-repair publishing). A strict phase's is post + hold/2 + 1 s: the blocks
# stored in the second half of the fault are still live at the end (a lost one is a false
# negative) and removals start before the fault ends (a lost one is a stale block).
WARMUP_MS=2000
PRE_SECS=3
LIVE_CAP_LOSSY=$((RATE * 3))
VERIFY_TIMEOUT_SECS=30
FRESH_ATTEMPTS=4
FRESH_TIMEOUT_SECS=15

# fault_plan NAME: "kind hold_secs post_secs" (kind lossy|strict) or "skip reason".
fault_plan() {
  case "$1" in
    baseline) echo "strict 0 2" ;;
    relay-kill) echo "lossy 3 8" ;;       # restart takes ~1-2 s, then 3 s of turnover
    relay-kill-partitioned)
      # inject takes 3 s (kill, then restart inside the partition); held 3 s more.
      if [[ "$IMPAIR" == none ]]; then echo "skip neither sch_netem nor nft available"; else echo "lossy 3 10"; fi ;;
    nats-restart) echo "lossy 4 8" ;;
    etcd-restart) echo "strict 5 2" ;;
    dc-partition) echo "strict 6 2" ;;    # TCP holds: nothing is lost, only late
    # Longer than etcd's keepalive (10 s + 5 s) and than nats-server's 10 s write deadline: once
    # the server's socket buffer to the relay fills (on TUN links it does; on veth, with larger
    # autotuned buffers, it did not) the server drops the relay as a slow consumer, so the
    # messages of the outage are lost by nature and the phase turns the live sets over. The
    # relay learns of the closed connection only when the server's retransmitted FIN gets through
    # after the repair (about 12 s later), so the phase publishes 16 s after the repair.
    dc-link-down) echo "lossy 15 16" ;;
    wan-partition) echo "strict 25 2" ;;  # longer than the relay's 20 s HTTP/2 keepalive
    wan-throttle)
      if [[ "$HTB" == yes || "$IMPAIR" == tun ]]; then echo "strict 10 2"; else echo "skip the kernel has no htb qdisc"; fi ;;
    loss)
      if [[ "$IMPAIR" == none ]]; then echo "skip neither sch_netem nor nft available"; else echo "strict 8 2"; fi ;;
    delay | reorder)
      if [[ "$DELAY" != none ]]; then echo "strict 8 2"; else echo "skip the kernel has no sch_netem (tc netem) and python3 is missing"; fi ;;
  esac
}
fault_description() {
  case "$1" in
    baseline) echo "no fault" ;;
    relay-kill) echo "kill -9 kvrelay, restart after 3 s" ;;
    relay-kill-partitioned) echo "DC<->relay dropped ($IMPAIR), kill -9 kvrelay, restart it 3 s later inside the partition, repair 3 s after that" ;;
    nats-restart) echo "kill -9 nats-server, restart after 4 s" ;;
    etcd-restart) echo "kill -9 etcd, restart after 5 s (same data dir)" ;;
    dc-partition) echo "DC<->relay: every packet dropped both ways ($IMPAIR) for 6 s" ;;
    dc-link-down) echo "DC<->relay: the relay's end of the link down for 15 s" ;;
    wan-partition) echo "relay<->WAN: every packet dropped both ways ($IMPAIR) for 25 s" ;;
    wan-throttle)
      if [[ "$IMPAIR" == tun ]]; then local how=tun; else local how=htb; fi
      echo "relay->WAN egress limited to 1 Mbit/s ($how) for 10 s" ;;
    loss) echo "10 % loss each way on both relay links ($IMPAIR) for 8 s" ;;
    delay) echo "50 ms +- 10 ms each way on both relay links ($DELAY) for 8 s" ;;
    reorder)
      if [[ "$DELAY" == proxy ]]; then
        echo "20 ms each way on both relay links, 25 % of chunks 20 ms later, in order (proxy: TCP's head-of-line blocking) for 8 s"
      elif [[ "$DELAY" == tun ]]; then
        echo "20 ms delay each way on both relay links, 25 % of packets sent at once, overtaking the held ones (tun) for 8 s"
      else
        echo "20 ms delay, 25 % reordered each way on both relay links (netem) for 8 s"
      fi ;;
  esac
}
# inject NAME: start the fault (returns once it holds).
inject() {
  case "$1" in
    baseline) ;;
    relay-kill) stop relay KILL 5 ;;
    relay-kill-partitioned)
      impair dc drop || return 1
      stop relay KILL 5
      sleep 3
      start_relay ;;
    nats-restart) stop nats KILL 5 ;;
    etcd-restart) stop etcd KILL 5 ;;
    dc-partition) impair dc drop ;;
    dc-link-down) ip -n "$NS_RELAY" link set dc1 down ;;
    wan-partition) impair wan drop ;;
    wan-throttle)
      if [[ "$IMPAIR" == tun ]]; then tun_mode wan "a2b rate 1000"; return; fi
      ip netns exec "$NS_RELAY" tc qdisc replace dev wan1 root handle 1: htb default 10 &&
        ip netns exec "$NS_RELAY" tc class add dev wan1 parent 1: classid 1:10 htb rate 1mbit ceil 1mbit ;;
    loss) impair dc loss 10 && impair wan loss 10 ;;
    delay)
      if [[ "$DELAY" == proxy ]]; then signal_proxies USR1
      elif [[ "$DELAY" == tun ]]; then tun_mode dc "both delay 50 10" && tun_mode wan "both delay 50 10"; else
        impair dc "netem delay 50ms 10ms" && impair wan "netem delay 50ms 10ms"; fi ;;
    reorder)
      if [[ "$DELAY" == proxy ]]; then signal_proxies HUP
      elif [[ "$DELAY" == tun ]]; then tun_mode dc "both reorder 20 25" && tun_mode wan "both reorder 20 25"; else
        impair dc "netem delay 20ms reorder 25% 50%" && impair wan "netem delay 20ms reorder 25% 50%"; fi ;;
  esac
}
# repair NAME: undo the fault.
repair() {
  case "$1" in
    relay-kill) start_relay ;;
    nats-restart) start_nats ;;
    etcd-restart) start_etcd ;;
    *) clear_impairments ;;
  esac
}

add_row() { ROWS+=("| $1 | $2 | $3 | $4 | $5 | $6 | $7 | $8 |"); }

run_phase() {
  local index="$1" fault="$2" plan kind hold post live_cap duration ns seed dir trace
  local t_repair t_trace="" t_pass="" status follower="no" fresh=0 attempt note=""
  plan="$(fault_plan "$fault")"
  if [[ "$plan" == skip* ]]; then
    log "phase $index $fault: skipped (${plan#skip })"
    add_row "$fault" "$(fault_description "$fault")" "skipped" "-" "-" "-" "-" "${plan#skip }"
    return
  fi
  read -r kind hold post <<<"$plan"
  if [[ "$kind" == lossy ]]; then
    live_cap=$LIVE_CAP_LOSSY
  else
    live_cap=$((RATE * (post + (hold + 1) / 2 + 1)))
  fi
  duration=$((PRE_SECS + hold + post))
  ns="chaos$index"
  seed=$((100 + index))
  dir="$LOGS/phase-$index-$fault"
  mkdir -p "$dir"
  trace="$dir/trace.json"
  check_deadline
  if ! alive relay || ! wait_ready 30; then
    log "phase $index $fault: the relay is not ready before the fault; restarting it"
    stop relay TERM 10
    start_relay
    wait_ready 60 || exit 3
  fi
  metrics >"$dir/metrics-before.txt"
  log "phase $index $fault ($kind): $(fault_description "$fault"); publishing ${duration}s, live cap $live_cap"

  # 1. The follower subscribes before anything is published and rides through the fault.
  start_in "$NS_WAN" verify-follower "$dir/follower.err" \
    "$LOADGEN" --verify-only --verify "$VERIFY_ADDR" --trace "$trace" \
    --trace-wait-secs $((duration + 40)) --verify-timeout-secs "$VERIFY_TIMEOUT_SECS" \
    --quiet-ms 1000 --seed "$seed"
  # 2. The workers: registered in etcd, publishing on NATS, lingering after the trace.
  start_in "$NS_DC" loadgen "$dir/loadgen.err" \
    "$LOADGEN" --etcd "$ETCD_URL" --nats "$NATS_URL" --namespace "$ns" \
    --pools 2 --workers-per-pool 2 --ranks 1 --rate "$RATE" --blocks-per-event 4 \
    --chain-share 0.5 --live-cap "$live_cap" --duration-secs "$duration" \
    --load-interval-ms 500 --warmup-ms "$WARMUP_MS" --seed "$seed" --trace "$trace" \
    --linger-secs $((VERIFY_TIMEOUT_SECS + FRESH_ATTEMPTS * (FRESH_TIMEOUT_SECS + 5) + 30))
  sleep "$(awk -v w="$WARMUP_MS" -v p="$PRE_SECS" 'BEGIN { print w / 1000 + p }')"

  # 3. Fault, hold, repair.
  log "phase $index $fault: inject"
  inject "$fault" || note="injection failed; "
  sleep "$hold"
  log "phase $index $fault: repair"
  repair "$fault" || note+="repair failed; "
  t_repair="$EPOCHREALTIME"

  # 4. Until the trace is written (and in the waits below): when is the relay ready again, when
  # does it route KV events again?
  local i bound=$((post + 30))
  T_READY="" T_EVENTS=""
  ROUTED_AT_REPAIR="$(routed_batches)"
  for ((i = 0; i < bound * 4; i++)); do
    check_deadline
    watch_relay
    if [[ -f "$trace" ]]; then t_trace="$EPOCHREALTIME"; break; fi
    alive loadgen || break
    sleep 0.25
  done
  if [[ -z "$t_trace" ]]; then
    note+="loadgen wrote no trace (see loadgen.err); "
  else
    log "phase $index $fault: trace written $(diff_secs "$t_repair" "$t_trace")s after repair"
    # 5. The follower's verdict, then fresh verifiers until one passes.
    wait_exit verify-follower $((VERIFY_TIMEOUT_SECS + 15))
    status="$EXITED"
    if [[ "$status" == 0 ]]; then
      follower=yes
      t_pass="$EPOCHREALTIME"
    else
      follower="no (exit $status)"
      [[ "$status" == running ]] && stop verify-follower TERM 5
      for ((attempt = 1; attempt <= FRESH_ATTEMPTS; attempt++)); do
        check_deadline
        fresh=$attempt
        start_in "$NS_WAN" "verify-fresh" "$dir/fresh-$attempt.err" \
          "$LOADGEN" --verify-only --verify "$VERIFY_ADDR" --trace "$trace" \
          --verify-timeout-secs "$FRESH_TIMEOUT_SECS" --quiet-ms 1000 --seed "$((seed * 10 + attempt))"
        wait_exit verify-fresh $((FRESH_TIMEOUT_SECS + 10))
        status="$EXITED"
        if [[ "$status" == 0 ]]; then t_pass="$EPOCHREALTIME"; break; fi
        [[ "$status" == running ]] && stop verify-fresh TERM 5
        log "phase $index $fault: fresh verifier $attempt failed (exit $status)"
        sleep 1
      done
    fi
  fi
  watch_relay
  metrics >"$dir/metrics-after.txt"
  # Whether the relay process that should be running still is.
  if ! alive relay; then
    note+="the relay process died (log relay-$RELAY_STARTS.log); "
    wait "${PIDS[relay]:-0}" 2>/dev/null
    unset "PIDS[relay]"
  fi
  stop verify-follower TERM 5
  stop loadgen TERM 15   # SIGTERM ends its linger; it revokes its lease
  clear_impairments

  local survived=no converge="-" ready="-" events="-" counters
  if [[ -n "$t_pass" ]]; then survived=yes; converge="$(diff_secs "$t_repair" "$t_pass")"; fi
  [[ -n "$T_READY" ]] && ready="$(diff_secs "$t_repair" "$T_READY")"
  [[ -n "$T_EVENTS" ]] && events="$(diff_secs "$t_repair" "$T_EVENTS")"
  [[ -n "$t_trace" ]] && note+="published $(diff_secs "$t_repair" "$t_trace") s after repair; "
  counters="$(phase_counters "$dir")"
  [[ -n "$counters" ]] && note+="relay: $counters"
  [[ "$survived" == yes ]] || FAILED=1
  log "phase $index $fault: survived $survived, converged ${converge}s after repair, follower $follower"
  add_row "$fault" "$(fault_description "$fault")" "$survived" "$converge" "$ready" "$events" \
    "$follower$([[ "$fresh" -gt 0 ]] && echo ", fresh verifiers: $fresh")" "${note%; }"
}

# phase_counters DIR: what the relay counted during the phase (non-zero deltas of a few families).
phase_counters() {
  local dir="$1" name before after out=()
  [[ -s "$dir/metrics-after.txt" ]] || { echo "no /metrics after the phase"; return; }
  for name in kvrelay_event_plane_disconnects_total kvrelay_discovery_reconnects_total \
    kvrelay_discovery_rebinds_total \
    kv_dc_relay_subscriber_lagged_total kvrelay_pool_events_rejected; do
    before="$(metric "$dir/metrics-before.txt" "$name")"
    after="$(metric "$dir/metrics-after.txt" "$name")"
    # A restarted relay counts from zero: its whole count is the phase's.
    ((after < before)) && before=0
    ((after != before)) && out+=("${name#kvrelay_} +$((after - before))")
  done
  local joined
  joined="$(IFS=,; echo "${out[*]}")"
  echo "${joined//,/, }"
}

# ---- main ------------------------------------------------------------------------------------------
log "mode $MODE: faults ${FAULTS[*]}; deadline ${DEADLINE_SECS}s; logs in $LOGS"
make_network
start_stack
index=0
for fault in "${FAULTS[@]}"; do
  index=$((index + 1))
  run_phase "$index" "$fault"
done

TABLE="$(
  echo "| fault | what | survived | converge s | ready s | events s | follower | notes |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${ROWS[@]}"
)"
HEADER="kvrelay chaos, $MODE mode, $(date -u +%Y-%m-%dT%H:%MZ), rev $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown), debug build, rate $RATE stored events/s, impairments $IMPAIR, delay $DELAY, load average $(cut -d' ' -f1-3 /proc/loadavg), $(t) s"
echo
echo "$HEADER"
echo
echo "$TABLE"
if [[ -n "$OUT" ]]; then
  { echo "$HEADER"; echo; echo "$TABLE"; } >"$OUT"
  log "table written to $OUT"
fi
exit "$FAILED"
