"""The CLI fuzz suite, wider and longer than in the test suite: every command with many more generated cases,
the slow kinds included (provisioning runs that start ansible-playbook, rollouts that render and try their
nodes, preflight --local with its torchrun sweep), failures collected rather than stopping at the first.

    python bench/fuzz_cli.py [--examples 150] [--workers 2] [--timeout 60] [--only plan,render] [--json]

Each worker is one pytest process running tests/unit/fuzz/test_cli_fuzz.py with its own hypothesis seed (and its
own forking zygote); every case is judged by tests/unit/fuzz/harness.py (no traceback, no hang, no signal, exit
0-3, one `error:` line on exit 2, no escape sequence, nothing executed, nothing written on bad input) and
appended to a JSON-lines file; this script sums them up. Exit 1 if any case failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tests" / "unit" / "fuzz" / "test_cli_fuzz.py"


def run(examples: int, workers: int, timeout: float, only: list[str], seed: int) -> tuple[list[dict], float]:
    with tempfile.TemporaryDirectory(prefix="stepdeploy-fuzz-bench-") as scratch:
        stats = [Path(scratch) / f"worker{i}.jsonl" for i in range(workers)]
        selection = ["-k", " or ".join(only)] if only else []  # the command families are the test ids
        started = time.monotonic()
        procs = []
        for i, path in enumerate(stats):
            env = {**os.environ, "STEPDEPLOY_FUZZ_EXAMPLES": str(examples), "STEPDEPLOY_FUZZ_WIDE": "1",
                   "STEPDEPLOY_FUZZ_COLLECT": "1", "STEPDEPLOY_FUZZ_STATS": str(path),
                   "STEPDEPLOY_FUZZ_TIMEOUT": str(timeout)}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider", "-x", "--no-header",
                 f"--hypothesis-seed={seed + i}", "--basetemp", str(Path(scratch) / f"tmp{i}"), *selection],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate()[0] for p in procs]
        seconds = time.monotonic() - started
        for proc, output in zip(procs, outputs, strict=True):
            if proc.returncode not in (0, 1):
                sys.stderr.write(output[-3000:])
        rows = [json.loads(line) for path in stats if path.exists() for line in path.read_text().splitlines()]
    return rows, seconds


def summary(rows: list[dict], seconds: float, args: argparse.Namespace) -> dict:
    failing = [r for r in rows if r["problems"]]
    kinds = collections.Counter(p.split(":")[0] for r in failing for p in r["problems"])
    by_command = collections.Counter(r["command"].split()[0] if r["command"] else "(none)" for r in rows)
    exits = collections.Counter(r["rc"] for r in rows)
    slowest = sorted(rows, key=lambda r: -r["seconds"])[:5]
    return {"command": " ".join(["python bench/fuzz_cli.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "cases": len(rows), "failures": len(failing),
            "failure_kinds": dict(kinds), "seconds": round(seconds, 1), "workers": args.workers,
            "per_case_s_median": round(sorted(r["seconds"] for r in rows)[len(rows) // 2], 3) if rows else None,
            "slowest": [{"argv": " ".join(r.get("argv") or []) or r["command"], "seconds": r["seconds"]}
                        for r in slowest],
            "max_rss_mib": round(max((r["maxrss_kib"] for r in rows), default=0) / 1024, 1),
            "exit_codes": {str(k): v for k, v in sorted(exits.items())}, "cases_per_command": dict(by_command),
            "failing": [{"argv": r["argv"], "problems": r["problems"], "stderr": r["stderr"]} for r in failing[:20]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=150, help="cases per command and worker")
    parser.add_argument("--workers", type=int, default=2, help="parallel pytest processes (seeds)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one case may take")
    parser.add_argument("--only", default="", help="comma-separated command families (default: all)")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--json", action="store_true", help="print the whole summary as JSON")
    args = parser.parse_args()
    rows, seconds = run(args.examples, args.workers, args.timeout, [o for o in args.only.split(",") if o], args.seed)
    result = summary(rows, seconds, args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['cases']} cases, {result['failures']} failing, {result['seconds']} s on {args.workers} "
              f"worker(s), median {result['per_case_s_median']} s a case, max RSS {result['max_rss_mib']} MiB")
        print(f"exit codes: {result['exit_codes']}; per command: {result['cases_per_command']}")
        for failure in result["failing"]:
            print(f"FAIL {failure['argv']}: {failure['problems']}\n{(failure['stderr'] or '')[-1500:]}")
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
