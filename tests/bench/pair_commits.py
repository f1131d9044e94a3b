"""Pair a benchmark of this checkout with the same benchmark of another checkout, run by run.

    python tests/bench/pair_commits.py --base /path/to/checkout-at-7224a82 --pairs 6 -- \\
        tests/bench/bench_handoff.py --parts tensors,state --quick --rounds 5

Each checkout runs its own copy of the benchmark script with its own code on the import path
(PYTHONPATH=<checkout>/client:<checkout>/daemon, the working directory its root); the two
alternate, and which goes first alternates too (A B, B A, A B ...), so a drift in the machine's
speed during the call falls on both. Each run writes `--json` (the schema of
tests/bench/bench_handoff.py: `series` -> {label, unit, per_round}, `targets` -> the ratios it
judges, taken within each round); for every series and target both
checkouts measured, the median of a run's rounds is taken, then the ratio this / base within
each pair, and the ratios' median [min - max] over the pairs is printed. Ratios near 1 whose
range straddles 1 are noise on a shared machine; quote the median with its range.

The other checkout needs its C extensions built in place (`python setup.py build_ext --inplace`)
and must accept the same benchmark arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def run_once(checkout: Path, script: str, args: list[str], out: Path) -> dict[str, float]:
    """Run `script` of `checkout` once; the median of each series' rounds (series -> value)."""
    env = dict(os.environ, PYTHONPATH=f"{checkout / 'client'}{os.pathsep}{checkout / 'daemon'}")
    command = [sys.executable, str(checkout / script), *args, "--json", str(out)]
    done = subprocess.run(command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{checkout}: {' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    doc = json.loads(out.read_text())
    got = {f"{k} ({v['unit']})": statistics.median(v["per_round"]) for k, v in doc["series"].items() if v["per_round"]}
    # the benchmark's own targets are ratios taken within each round (against DCP or a floor
    # measured in the same round): the machine's load cancels out of them
    got |= {f"target: {v['target']}": v["median"] for v in doc.get("targets", []) if v.get("median")}
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (the baseline)")
    parser.add_argument("--pairs", type=int, default=4, help="pairs of runs (default 4)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: the benchmark, relative to each checkout's root")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        parser.error("name the benchmark after --, e.g. -- tests/bench/bench_handoff.py --quick")
    base = args.base.resolve()
    for tree in (HERE, base):
        if not (tree / bench[0]).exists():
            parser.error(f"{tree / bench[0]} does not exist")
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ckptd-pair-") as scratch:
        for pair in range(args.pairs):
            order = [(HERE, "this"), (base, "base")] if pair % 2 == 0 else [(base, "base"), (HERE, "this")]
            got: dict[str, dict[str, float]] = {}
            for tree, name in order:
                got[name] = run_once(tree, bench[0], bench[1:], Path(scratch) / f"{pair}-{name}.json")
                print(f"pair {pair + 1}/{args.pairs}: {name} done (load average {os.getloadavg()[0]:.1f})", flush=True)
            for key in sorted(set(got["this"]) & set(got["base"])):
                if got["base"][key]:
                    ratios.setdefault(key, []).append(got["this"][key] / got["base"][key])
    print(f"\nthis checkout ({HERE}) / base ({base}), {args.pairs} pairs, each a median of its run's rounds:")
    for key, values in ratios.items():
        print(f"  {key}: {statistics.median(values):.2f} [{min(values):.2f} - {max(values):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
