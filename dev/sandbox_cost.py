"""
Per-call cost of the bubblewrap sandbox: nanorl/execution.py as it is now against the same file at another git
revision, `print(1)` run N times, the two interleaved so a busy neighbour slows both alike.

    python dev/sandbox_cost.py --against a096053 -n 40
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--against", required=True, help="git revision whose nanorl/execution.py is the baseline")
    parser.add_argument("-n", type=int, default=40, help="calls per version")
    args = parser.parse_args()
    old_src = subprocess.run(
        ["git", "show", f"{args.against}:nanorl/execution.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "old_execution.py"), "w") as f:
            f.write(old_src)
        versions = {
            args.against: load(f.name, "old_execution"),
            "now": load(os.path.join(ROOT, "nanorl", "execution.py"), "now_execution"),
        }
        for m in versions.values():
            m.execute_code("print(1)", mode="bwrap")  # the one-off work (the mount list) is not a call's cost
        times = {k: [] for k in versions}
        for _ in range(args.n):
            for k, m in versions.items():
                t = time.perf_counter()
                r = m.execute_code("print(1)", mode="bwrap")
                times[k].append(time.perf_counter() - t)
                if r.stdout != "1\n":
                    sys.exit(f"{k}: the sandbox did not run print(1): {r.error or r.stderr}")
    for k, v in times.items():
        print(
            f"{k}: median {statistics.median(v) * 1000:.1f} ms, mean {statistics.mean(v) * 1000:.1f} ms "
            f"over {args.n} calls"
        )


if __name__ == "__main__":
    main()
