"""Issue 18's fuzz suite: every command and option of `stepdeploy`, driven with generated bad input, hostile
values and corrupt files (inventories, group_vars, ledgers, manifests, facts, layouts, numbers, paths).

Each case runs as `stepdeploy ARGV` in its own forked process (tests/unit/fuzz/zygote.py) under a time limit
(STEPDEPLOY_FUZZ_TIMEOUT, 45 s) and a memory limit (STEPDEPLOY_FUZZ_MEMORY, 3 GiB), and is judged by
tests/unit/fuzz/harness.py: no traceback, no hang, no signal, exit 0-3, exactly one `error:` line when exit 2, no
escape sequence from the input on the terminal, nothing executed, nothing written when the input was bad.

The examples per command are kept small so the suite adds about two minutes on two cores; bench/fuzz_cli.py
runs the same generators wider and longer (STEPDEPLOY_FUZZ_EXAMPLES, STEPDEPLOY_FUZZ_WIDE).
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from .cases import COMMANDS, Case
from .harness import Runner

# examples per command: the in-suite figure, or the bench's
EXAMPLES = {"inventory": 25, "plan": 25, "render": 30, "report": 25, "rollout": 30, "run": 25, "preflight": 20,
            "provision": 12, "sim": 15, "demo": 6, "data": 15, "stray": 15}
BENCH = int(os.environ.get("STEPDEPLOY_FUZZ_EXAMPLES", "0"))
_counter = itertools.count()


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    zygote = Runner()
    yield zygote
    zygote.close()


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-fuzz")


def run_case(runner: Runner, root: Path, case: Case) -> None:
    case_dir = root / f"case{next(_counter)}"
    case_dir.mkdir()
    case.make(case_dir)
    verdict = runner.run(case_dir, case.argv, case.env)
    if verdict.problems and not os.environ.get("STEPDEPLOY_FUZZ_COLLECT"):
        pytest.fail(verdict.describe(), pytrace=False)
    if not verdict.problems:
        shutil.rmtree(case_dir, ignore_errors=True)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_input_makes_a_command_trace_back_hang_or_half_write(command: str, runner: Runner, fuzz_root: Path) -> None:
    strategy = COMMANDS[command]()
    phases = (Phase.explicit, Phase.generate) if BENCH else (Phase.explicit, Phase.generate, Phase.shrink)

    @settings(max_examples=BENCH or EXAMPLES[command], deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case: Case) -> None:
        run_case(runner, fuzz_root, case)

    check()


def test_the_judge_is_not_blind(tmp_path: Path) -> None:
    """A traceback, two error lines or a changed directory after bad input each fail a case."""
    from .harness import judge

    stderr = 'Traceback (most recent call last):\n  File "x", line 1\nZeroDivisionError: division by zero\n'
    verdict = judge(["plan"], {"rc": 1, "timed_out": False, "seconds": 0.1}, "", stderr, {}, {}, tmp_path)
    assert verdict.problems == ["traceback"]
    two = judge(["plan"], {"rc": 2, "timed_out": False, "seconds": 0.1}, "", "error: a\nerror: b\n", {},
                {"out/": (0, 0)}, tmp_path)
    assert len(two.problems) == 2 and "2 'error:' lines" in two.problems[0] and "out/" in two.problems[1]
    (tmp_path / "PWNED").touch()
    hung = judge(["plan"], {"rc": -9, "timed_out": True, "seconds": 45}, "\x1b[2J", "", {}, {}, tmp_path)
    assert [p.split(":")[0] for p in hung.problems] == ["hang", "an escape sequence reached the terminal",
                                                        "a hostile value was executed (PWNED marker)"]


def test_the_json_check_refuses_two_documents_and_accepts_one() -> None:
    """What the fuzz run asks of every --json command that exits 0 or 1 (issue 22: exactly one document)."""
    from .harness import _one_json_document

    assert _one_json_document('{"a": 1}\n') == []
    assert _one_json_document('{"a": 1}\n{"b": 2}\n')
    assert _one_json_document("")
