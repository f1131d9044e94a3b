"""The chaos suite's long run (issue 30): `python tests/bench/chaos.py [--minutes 20] [--seed N]`.

Three nodes on loopback, two jobs on the same daemons, random SIGKILLs of daemons and ranks and
injected faults (damaged data files and replicas, a full disk, a slow disk) for `--minutes`;
then every acknowledged step of both jobs is loaded and compared bit for bit
(tests/chaos_rig.py). Prints the counts and every failure; exits 1 on a failure. CI runs a
short one (tests/integration/test_chaos.py). Needs root for the small tmpfs roots of the
full-disk fault (skipped otherwise, and said)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chaos_rig import Chaos  # noqa: E402  tests/chaos_rig.py


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, roots) and print where")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptd-chaos-"))
    chaos = Chaos(base / "run", seconds=args.minutes * 60, seed=args.seed, nodes=args.nodes)
    try:
        report = chaos.run()
    finally:
        chaos.close()
    print(report.summary())
    for failure in report.failures:
        print("FAILURE:", failure)
    if args.keep:
        print("kept:", base)
    else:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
