"""One benchmark on two revisions of this repository in one run, alternating: does a change cost anything?

Each revision is checked out (`git worktree`, detached) into a temporary folder; each run is that revision's own
benchmark script, on that revision's package (put first on the import path: its `src/`, or for a revision from before
the src layout, a folder holding the checkout as `infer/`), with this checkout's virtualenv. Rounds alternate the
revisions (before, after, after, before, ...); the JSON each run writes under its worktree's benchmarks/results/ is
read back, and each `--metric` (a dotted path into it: `rows.0.results.infer.tok_per_s`) is reported per revision as
the median of its rounds, with after / before. Writes benchmarks/results/revisions-*.json here, with every run's JSON.

    .venv/bin/python benchmarks/revisions.py --before 392456f --rounds 3 \\
        --metric rows.0.results.infer.tok_per_s -- throughput.py --workloads B1 --systems infer --dtypes float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(revision: str, into: Path) -> tuple[Path, Path]:
    """(the worktree, the folder to put first on the import path) of `revision` checked out under `into`."""
    sha = git("rev-parse", "--verify", f"{revision}^{{commit}}")
    tree = into / sha[:12] / "infer"  # named `infer`: a root-layout revision is imported from its parent
    tree.parent.mkdir(parents=True)
    git("worktree", "add", "--detach", str(tree), sha)
    return tree, tree / "src" if (tree / "src" / "infer").is_dir() else tree.parent


def metric(result: dict, path: str) -> float:
    value: object = result
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]  # type: ignore[index]
    if not isinstance(value, (int, float)):
        raise ValueError(f"{path}: {value!r} is not a number")
    return float(value)


def run(tree: Path, import_root: Path, command: list[str], timeout: float) -> dict:
    """That revision's benchmark script run once; the JSON it wrote."""
    results = tree / "benchmarks" / "results"
    before = set(results.glob("*.json")) if results.is_dir() else set()
    env = dict(os.environ, PYTHONPATH=str(import_root))
    script = tree / "benchmarks" / command[0]
    proc = subprocess.run(
        [sys.executable, str(script), *command[1:]], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
    )
    new = sorted(set(results.glob("*.json")) - before) if results.is_dir() else []
    if proc.returncode != 0 or not new:
        raise RuntimeError(
            f"{script} exited {proc.returncode}, wrote {len(new)} results:\n{proc.stdout[-2000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
    return json.loads(new[-1].read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="a revision (commit, tag, branch)")
    p.add_argument("--after", default="HEAD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--metric", action="append", required=True, help="a dotted path into the script's JSON")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("command", nargs="+", help="the script under benchmarks/ and its arguments (after --)")
    args = p.parse_args()
    revisions = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict]] = {name: [] for name in revisions}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: checkout(rev, Path(tmp) / name) for name, rev in revisions.items()}
        try:
            for r in range(args.rounds):
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    start = time.perf_counter()
                    result = run(*trees[name], args.command, args.timeout)
                    runs[name].append(result)
                    got = ", ".join(f"{m} {metric(result, m):.4g}" for m in args.metric)
                    print(f"round {r} {name}: {got} ({time.perf_counter() - start:.0f} s)", flush=True)
        finally:
            for tree, _ in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    summary = {}
    for m in args.metric:
        before = statistics.median(metric(r, m) for r in runs["before"])
        after = statistics.median(metric(r, m) for r in runs["after"])
        summary[m] = {"before": before, "after": after, "after_over_before": after / before}
        print(f"{m}: before {before:.4g}, after {after:.4g}, after / before {after / before:.3f}")
    out = write_result(
        "revisions",
        {
            "before": git("rev-parse", "--short", args.before),
            "after": git("rev-parse", "--short", args.after),
            "command": args.command,
            "rounds": args.rounds,
            "summary": summary,
            "runs": runs,
        },
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
