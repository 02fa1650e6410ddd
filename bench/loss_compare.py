"""Loss curves of runs side by side, each against a BASE run, and whether they stay within the noise of a rerun
(issue 40: an engine change must leave the training loss within bf16 noise of the current engine).

    python bench/loss_compare.py BASE VARIANT... [--noise RUN] [--match SUBSTR] [--every N] [--from K]
                                 [--plot PNG] [--json]

Each run is a metrics.jsonl, or a directory: then the one `**/out/metrics.jsonl` below it (sorted; with --match
only those whose path below the directory contains SUBSTR; more than one left is an error that lists them). The
first run is BASE, the others are VARIANTs; --noise names a second run of the unchanged engine (same seed), whose
difference from BASE is the noise floor.

The lines are a node's, read as untrusted: each goes through stepdeploy.noderecords (bounded JSON, then
`metrics_record`); a line that fails, or that has no finite `loss`, is skipped and counted per file. A NaN loss
is skipped too, so read the skipped counts: a run that went NaN is compared on its finite iterations only.
Profiled lines count like the others. An iteration written twice (a restart redid it) keeps its last line.

The table shows every N-th iteration of BASE (and the last one all runs share): each run's loss and its signed
difference from BASE. The summary, over the iterations a run shares with BASE from K on: their count, the mean
and the max of |loss - base| (and where the max is), and both losses at the last shared iteration.

Verdict (only with --noise): a variant is within noise when its mean |loss - base| <= 2 x the noise run's mean
|loss - base| AND its max |loss - base| <= 2 x the noise run's max |loss - base|; otherwise it is outside noise.
Exit 0; 1 when --noise is given and a variant is outside noise; 2 for bad input (a missing file, an ambiguous
directory, a file without a usable loss line, no iteration shared with BASE). Standard library and stepdeploy;
matplotlib only for --plot.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without an installed stepdeploy too

from stepdeploy import noderecords  # noqa: E402
from stepdeploy.noderecords_stream import FileCursor  # noqa: E402

RULE = ("within noise: mean |loss - base| <= 2 x the noise run's mean |loss - base| and max |loss - base| <= "
        "2 x the noise run's max |loss - base|")
NO_VERDICT = "no noise run given: no verdict"
FACTOR = 2.0


class InputError(Exception):
    """Bad input: the message says what; exit 2."""


@dataclass
class Run:
    label: str
    path: Path
    losses: dict[int, float] = field(default_factory=dict)  # iteration -> loss (the last line of each)
    skipped: int = 0  # lines that failed the schema or had no finite loss
    nonfinite: int = 0  # of those, lines whose loss is NaN or infinite
    repeated: int = 0  # lines for an iteration already seen (the later one kept)
    first_skip: str | None = None
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        its = sorted(self.losses)
        return {"path": str(self.path), "iterations": len(its), "first_iteration": its[0], "last_iteration": its[-1],
                "skipped_lines": self.skipped, "nonfinite_loss_lines": self.nonfinite,
                "repeated_iterations": self.repeated, "first_skipped": self.first_skip, "warnings": self.warnings}


# --- input --------------------------------------------------------------------------------------------------


def resolve(path: Path, match: str | None) -> Path:
    """`path` itself when a file; else the one `**/out/metrics.jsonl` below it (whose path below it contains
    `match`, when given). InputError when there is none or more than one."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise InputError(f"{path}: no such file or directory")
    found = sorted(p for p in path.glob("**/out/metrics.jsonl") if p.is_file())
    if match is not None:
        found = [p for p in found if match in str(p.relative_to(path))]
    where = f"{path}: " + ("no **/out/metrics.jsonl" if match is None else
                           f"no **/out/metrics.jsonl whose path contains {match!r}")
    if not found:
        raise InputError(where)
    if len(found) > 1:
        listed = "\n".join(f"  {p}" for p in found)
        raise InputError(f"{path}: {len(found)} metrics.jsonl below it; pick one with --match SUBSTR "
                         f"(a part of its path below {path}):\n{listed}")
    return found[0]


def read_run(label: str, path: Path) -> Run:
    """The finite losses of one metrics.jsonl, per iteration (the last line of each); the other lines counted.
    Read as the controller reads a node's metrics (noderecords_stream.FileCursor: bounded lines, regular files
    only), with a line without a finite loss counted bad like one that fails the schema."""
    run = Run(label, path)

    def with_loss(data: Any) -> dict[str, Any]:
        record = noderecords.metrics_record(data)
        loss = record.get("loss")  # metrics_record keeps a number (NaN included) and drops anything else
        if loss is None:
            raise noderecords.BadRecord("no loss")
        if not math.isfinite(loss):
            run.nonfinite += 1
            raise noderecords.BadRecord(f"loss {loss}")
        return record

    source = str(path)
    tally = noderecords.Tally()
    for record in FileCursor(path.resolve(), source, with_loss, allow_nan=True).read(tally):
        if record["iteration"] in run.losses:
            run.repeated += 1
        run.losses[record["iteration"]] = record["loss"]  # the later line wins: a restart redid the iteration
    run.skipped, run.first_skip = tally.bad.get(source, 0), tally.first.get(source)
    run.warnings = list(tally.warnings)
    if not run.losses:
        why = f" (first skipped: {run.first_skip})" if run.first_skip else " (it has no lines)"
        raise InputError(f"{path}: no line with an iteration and a finite loss{why}")
    run.losses = dict(sorted(run.losses.items()))
    return run


# --- comparing ----------------------------------------------------------------------------------------------


def compare(base: Run, other: Run, start: int) -> dict[str, Any]:
    """|other - base| over the iterations both have, from `start` on. InputError when they share none."""
    common = [i for i in base.losses if i >= start and i in other.losses]
    if not common:
        raise InputError(f"{other.path}: no iteration in common with BASE ({base.path}) at or after {start}")
    diffs = [abs(other.losses[i] - base.losses[i]) for i in common]
    worst = max(range(len(common)), key=lambda k: diffs[k])  # the first of equal maxima
    last = common[-1]
    return {"label": other.label, "path": str(other.path), "n": len(common),
            "mean_abs_diff": statistics.fmean(diffs), "max_abs_diff": diffs[worst],
            "max_abs_diff_iteration": common[worst], "final_iteration": last,
            "final_base": base.losses[last], "final_variant": other.losses[last]}


def judge(summary: dict[str, Any], noise: dict[str, Any]) -> tuple[str, list[str]]:
    """("within noise" | "outside noise", the limits it broke)."""
    broke = []
    for key, name in (("mean_abs_diff", "mean"), ("max_abs_diff", "max")):
        limit = FACTOR * noise[key]
        # up to float rounding: a difference of two 5-decimal losses carries an error of ~1e-16
        if summary[key] > limit and not math.isclose(summary[key], limit, rel_tol=1e-9, abs_tol=1e-12):
            broke.append(f"{name} |diff| {summary[key]:.6f} > {FACTOR:g} x {noise[key]:.6f}")
    return ("outside noise" if broke else "within noise"), broke


def table_rows(base: Run, others: list[Run], every: int) -> list[dict[str, Any]]:
    """Every `every`-th iteration of BASE and the last one all runs share: each run's loss and its diff."""
    shared = set(base.losses).intersection(*(o.losses for o in others))
    shown = {i for i in base.losses if i % every == 0}
    if shared:
        shown.add(max(shared))
    rows = []
    for i in sorted(shown):
        row: dict[str, Any] = {"iteration": i, "base": base.losses[i]}
        for other in others:
            loss = other.losses.get(i)
            row[other.label] = loss
            row[f"{other.label}-base"] = None if loss is None else loss - base.losses[i]
        rows.append(row)
    return rows


# --- output -------------------------------------------------------------------------------------------------


def _number(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{value:+.5f}" if signed else f"{value:.5f}"


def _ratio(value: float, noise: float) -> str:
    return f"{value / noise:.2f}x noise" if noise > 0 else ("= noise" if value == 0 else "noise is 0")


def print_text(runs: list[Run], rows: list[dict[str, Any]], summaries: list[dict[str, Any]],
               noise: dict[str, Any] | None, verdicts: dict[str, tuple[str, list[str]]], start: int) -> None:
    width = max(len(r.label) for r in runs)
    print("runs:")
    for run in runs:
        info = run.describe()
        line = (f"  {run.label:<{width}} = {run.path}: {info['iterations']} iterations "
                f"{info['first_iteration']}..{info['last_iteration']}, {run.skipped} line(s) skipped")
        if run.nonfinite:
            line += f" ({run.nonfinite} with a NaN/infinite loss)"
        if run.first_skip:
            line += f", first: {run.first_skip}"
        if run.repeated:
            line += f"; {run.repeated} iteration(s) written again, the last line kept"
        print(line)
        for warning in run.warnings:
            print(f"  {run.label:<{width}}   warning: {warning}")
    others = [r.label for r in runs[1:]]
    header = ["iteration", "base", *(c for label in others for c in (label, f"{label}-base"))]
    cols = max(10, *(len(h) + 1 for h in header))
    print()
    print("".join(h.rjust(cols) for h in header))
    for row in rows:
        cells = [str(row["iteration"]), _number(row["base"])]
        cells += [c for label in others for c in (_number(row[label]), _number(row[f"{label}-base"], signed=True))]
        print("".join(c.rjust(cols) for c in cells))
    print()
    print(f"summary: |loss - base| over the iterations shared with base, from iteration {start} on")
    for s in [*summaries, *([noise] if noise else [])]:
        line = (f"  {s['label']:<{width}} n={s['n']} mean {s['mean_abs_diff']:.6f}")
        if noise and s is not noise:
            line += f" ({_ratio(s['mean_abs_diff'], noise['mean_abs_diff'])})"
        line += f", max {s['max_abs_diff']:.5f} at iteration {s['max_abs_diff_iteration']}"
        if noise and s is not noise:
            line += f" ({_ratio(s['max_abs_diff'], noise['max_abs_diff'])})"
        line += (f"; final (iteration {s['final_iteration']}) base {s['final_base']:.5f}, "
                 f"{s['label']} {s['final_variant']:.5f}")
        print(line)
    print()
    if noise is None:
        print(NO_VERDICT)
        return
    print(f"verdict ({RULE}):")
    if noise["max_abs_diff"] == 0:
        print("  note: the noise run equals base exactly, so only an identical curve is within noise")
    nonfinite = {r.label: r.nonfinite for r in runs}
    for s in summaries:
        verdict, broke = verdicts[s["label"]]
        line = f"  {s['label']:<{width}} {verdict}" + (f" ({'; '.join(broke)})" if broke else "")
        if nonfinite[s["label"]]:
            line += f"; but {nonfinite[s['label']]} NaN/infinite loss line(s) were skipped: judged on the rest"
        print(line)


def plot(path: Path, runs: list[Run], noise_run: Run | None, noise: dict[str, Any] | None, start: int,
         title: str) -> None:
    """Loss against iteration for every run; below, |loss - base| of each variant and of the noise run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    base = runs[0]
    for n, run in enumerate(runs):
        its = list(run.losses)
        style = {"linestyle": "--", "color": "0.5"} if run is noise_run else {"color": f"C{n % 10}"}
        top.plot(its, list(run.losses.values()), linewidth=1, label=f"{run.label}: {_short(run.path)}", **style)
        if run is base:
            continue
        common = [i for i in its if i in base.losses]
        bottom.plot(common, [abs(run.losses[i] - base.losses[i]) for i in common], linewidth=1,
                    label=run.label, **style)
    top.set_ylabel("loss")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    if noise is not None:
        bottom.axhline(FACTOR * noise["max_abs_diff"], color="0.3", linewidth=0.8, linestyle="-.",
                       label=f"{FACTOR:g} x noise max")
    # symlog: the noise (1e-5..1e-2) and a divergence (0.1..) on one axis; a diff of 0 stays drawn
    bottom.set_yscale("symlog", linthresh=1e-5)
    bottom.set_ylim(0, max(1e-4, 2 * max(bottom.get_ylim())))
    bottom.set_ylabel("|loss - base|")
    bottom.set_xlabel("iteration")
    bottom.legend(fontsize=8)
    if start > 0:
        bottom.axvline(start, color="0.3", linewidth=0.8, linestyle=":")
    figure.savefig(path, dpi=110)


def _short(path: Path) -> str:
    """A run's name: the directory above out/ (RUN/out/metrics.jsonl), else the file's name."""
    return path.parent.parent.name if path.parent.name == "out" and path.parent.parent.name else path.name


# --- main ---------------------------------------------------------------------------------------------------


def _count(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, metavar="BASE",
                        help="a metrics.jsonl, or a directory with one **/out/metrics.jsonl")
    parser.add_argument("variants", type=Path, nargs="+", metavar="VARIANT", help="VARIANT runs, each like BASE")
    parser.add_argument("--noise", type=Path, metavar="RUN",
                        help="a rerun of BASE's engine (same seed): the noise floor")
    parser.add_argument("--match", metavar="SUBSTR",
                        help="in a directory, the metrics.jsonl whose path below it contains SUBSTR")
    parser.add_argument("--every", type=_count(1), default=10, metavar="N", help="a table row every N iterations (10)")
    parser.add_argument("--from", dest="start", type=_count(0), default=0, metavar="K",
                        help="leave iterations below K out of the summary (0)")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="write a PNG of the curves and their differences")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    try:
        named = [("base", args.base), *((f"v{k}", p) for k, p in enumerate(args.variants, 1))]
        if args.noise is not None:
            named.append(("noise", args.noise))
        runs = [read_run(label, resolve(path, args.match)) for label, path in named]
        base = runs[0]
        noise_run = runs[-1] if args.noise is not None else None
        variants = runs[1:-1] if noise_run else runs[1:]
        summaries = [compare(base, v, args.start) for v in variants]
        noise = compare(base, noise_run, args.start) if noise_run else None
    except InputError as exc:
        print(f"loss_compare: {exc}", file=sys.stderr)
        return 2
    verdicts = {s["label"]: judge(s, noise) for s in summaries} if noise else {}
    outside = [label for label, (verdict, _) in verdicts.items() if verdict == "outside noise"]
    overall = NO_VERDICT if noise is None else "outside noise" if outside else "within noise"
    rows = table_rows(base, runs[1:], args.every)
    if args.plot is not None:
        try:
            plot(args.plot, runs, noise_run, noise, args.start, f"loss against base ({overall})")
        except OSError as exc:
            print(f"loss_compare: cannot write {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if args.json:
        for s in summaries:
            s["verdict"], s["broke"] = verdicts.get(s["label"], (None, []))
        print(json.dumps({"rule": RULE, "from": args.start, "every": args.every, "verdict": overall,
                          "runs": {r.label: r.describe() for r in runs}, "variants": summaries,
                          "noise": noise, "rows": rows}))
    else:
        print_text(runs, rows, summaries, noise, verdicts, args.start)
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
