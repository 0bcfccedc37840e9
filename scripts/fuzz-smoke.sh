#!/usr/bin/env bash
# Build every fuzz target of relay/fuzz and run each for a short fixed time from its committed
# seed corpus, so the targets keep building and catch regressions. Needs the nightly toolchain
# and cargo-fuzz (`cargo install cargo-fuzz`). Usage: scripts/fuzz-smoke.sh [seconds per target]
set -euo pipefail

seconds="${1:-15}"
cd "$(dirname "$0")/../relay/fuzz"
cargo +nightly fuzz build -O
for target in $(cargo +nightly fuzz list); do
    # A scratch copy of the corpus: new inputs found here are not committed.
    scratch="$(mktemp -d)"
    cp -r "corpus/$target/." "$scratch/" 2>/dev/null || true
    echo "fuzz-smoke: $target (${seconds}s)"
    log="$scratch.log"
    status=0
    cargo +nightly fuzz run -O "$target" "$scratch" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 > "$log" 2>&1 ||
        status=$?
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)' "$log" || true
    rm -rf "$scratch"
    if [ "$status" -ne 0 ]; then
        # A crash, timeout or OOM: libFuzzer's report and the artifact path.
        tail -n 60 "$log" >&2
        echo "fuzz-smoke: $target failed (exit $status)" >&2
        exit 1
    fi
    rm -f "$log"
done
echo "fuzz-smoke: all targets ran"
