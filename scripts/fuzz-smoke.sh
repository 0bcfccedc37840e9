#!/usr/bin/env bash
# Build every fuzz target of relay/fuzz and run each for a short fixed time from its committed
# seed corpus, so the targets keep building and catch regressions. Installs cargo-fuzz when it
# is missing.
#   scripts/fuzz-smoke.sh [seconds per target]   build, then run every target
#   scripts/fuzz-smoke.sh --build-only           install and build only (CI overlaps this with
#                                                the single-threaded simulator sweep)
set -euo pipefail

build_only=0
if [ "${1:-}" = "--build-only" ]; then
    build_only=1
    shift
fi
seconds="${1:-15}"
cd "$(dirname "$0")/../relay/fuzz"
# libFuzzer needs the sanitizer flags only nightly accepts: the nightly toolchain when the
# machine has one, otherwise stable with RUSTC_BOOTSTRAP=1 for this build alone.
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fuzz=(cargo +nightly fuzz)
else
    export RUSTC_BOOTSTRAP=1
    fuzz=(cargo fuzz)
fi
if ! cargo fuzz --version > /dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz"
    cargo install --locked cargo-fuzz
fi
"${fuzz[@]}" build -O --fuzz-dir .
if [ "$build_only" -eq 1 ]; then
    echo "fuzz-smoke: every target built"
    exit 0
fi
for target in $("${fuzz[@]}" list --fuzz-dir .); do
    # A scratch copy of the corpus: new inputs found here are not committed.
    scratch="$(mktemp -d)"
    cp -r "corpus/$target/." "$scratch/" 2>/dev/null || true
    echo "fuzz-smoke: $target (${seconds}s)"
    log="$scratch.log"
    status=0
    "${fuzz[@]}" run -O --fuzz-dir . "$target" "$scratch" -- \
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
