#!/usr/bin/env python3
"""Per-file kill rate of `cargo mutants` runs, as a Markdown table.

    scripts/mutants-summary.py mutants.out/outcomes.json [LATER/outcomes.json ...]

Each later file overrides the outcome of the mutants it tested again (a re-run of the missed
ones with `cargo mutants --iterate`, or with `-F` for one function). A timeout counts as caught
(the mutant made the tests hang, which a test run notices); the kill rate is
(caught + timeout) / (caught + timeout + missed), unviable mutants (those that do not build)
left out. `--missed` lists the mutants still missed. `--only LIST` keeps the mutants named in
LIST (the output of `cargo mutants --list` on the tree measured), so outcomes of mutants whose
names changed since an earlier run (their lines moved) are not counted twice. `--replayed TSV`
overrides outcomes from lines `VERDICT<TAB>NAME` (caught, missed, unviable, or gone: the mutated
code no longer exists, and the mutant is dropped), as written by re-applying the missed
mutants' diffs to a later tree. `--missed-diffs` prints, instead of the table, one
`DIFF_PATH<TAB>NAME` line per missed mutant (the diff path relative to the output directory),
which `scripts/mutants-sweep.sh` applies one at a time.
"""

import json
import sys
from collections import OrderedDict

KINDS = {
    "CaughtMutant": "caught",
    "MissedMutant": "missed",
    "Timeout": "timeout",
    "Unviable": "unviable",
}


def outcomes(paths):
    latest = OrderedDict()
    for path in paths:
        with open(path, encoding="utf-8") as file:
            for outcome in json.load(file)["outcomes"]:
                mutant = outcome["scenario"]
                if not isinstance(mutant, dict) or "Mutant" not in mutant:
                    continue  # the baseline
                kind = KINDS.get(outcome["summary"])
                if kind is None:
                    raise SystemExit(f"{path}: unknown outcome {outcome['summary']!r}")
                name = mutant["Mutant"]["name"]
                latest[name] = (mutant["Mutant"]["file"], kind, outcome.get("diff_path"))
    return latest


def main(argv):
    show_missed = "--missed" in argv
    missed_diffs = "--missed-diffs" in argv
    argv = [arg for arg in argv if arg not in ("--missed", "--missed-diffs")]
    only = None
    if "--only" in argv:
        at = argv.index("--only")
        with open(argv[at + 1], encoding="utf-8") as file:
            only = {line.rstrip("\n") for line in file if line.strip()}
        del argv[at : at + 2]
    replayed = None
    if "--replayed" in argv:
        at = argv.index("--replayed")
        replayed = argv[at + 1]
        del argv[at : at + 2]
    paths = argv
    if not paths:
        raise SystemExit(__doc__)
    latest = outcomes(paths)
    if replayed is not None:
        with open(replayed, encoding="utf-8") as file:
            for line in file:
                verdict, _, name = line.rstrip("\n").partition("\t")
                if not name:
                    continue
                if name not in latest:
                    raise SystemExit(f"{replayed}: {name!r} is not among the outcomes")
                if verdict == "gone":
                    del latest[name]
                elif verdict in ("caught", "missed", "unviable", "timeout"):
                    latest[name] = (latest[name][0], verdict, latest[name][2])
                else:
                    raise SystemExit(f"{replayed}: unknown verdict {verdict!r}")
    if only is not None:
        untested = sorted(only - latest.keys())
        if untested:
            print(f"{len(untested)} listed mutants have no outcome, e.g. {untested[0]}")
        latest = OrderedDict((name, value) for name, value in latest.items() if name in only)
    if missed_diffs:
        for name, (_, kind, diff) in latest.items():
            if kind == "missed":
                print(f"{diff}\t{name}")
        return
    per_file = OrderedDict()
    for file, kind, _ in sorted(latest.values(), key=lambda value: value[:2]):
        per_file.setdefault(file, dict.fromkeys(KINDS.values(), 0))[kind] += 1
    total = dict.fromkeys(KINDS.values(), 0)
    print("| file | caught | timeout | missed | unviable | killed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for file, counts in list(per_file.items()) + [("**all**", total)]:
        if file != "**all**":
            for kind, count in counts.items():
                total[kind] += count
        killed = counts["caught"] + counts["timeout"]
        viable = killed + counts["missed"]
        rate = f"{100.0 * killed / viable:.1f} %" if viable else "—"
        print(
            f"| {file} | {counts['caught']} | {counts['timeout']} | {counts['missed']} "
            f"| {counts['unviable']} | {rate} |"
        )
    if show_missed:
        print()
        for name, (_, kind, _) in latest.items():
            if kind == "missed":
                print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
