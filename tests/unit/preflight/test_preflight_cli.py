"""`stepdeploy preflight` input errors: one line, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepdeploy", "preflight", *args], capture_output=True, text=True,
                          timeout=60)


def test_needs_an_inventory_or_local() -> None:
    res = _cli()
    assert res.returncode == 2
    assert res.stderr.startswith("error: give an inventory, or --local") and "Traceback" not in res.stderr


def test_local_with_several_hosts_and_unknown_limit() -> None:
    res = _cli("inventory/dgx.ini", "--local")
    assert res.returncode == 2 and "--limit" in res.stderr
    res = _cli("inventory/dgx.ini", "--limit", "nosuchhost")
    assert res.returncode == 2 and "nosuchhost" in res.stderr


def test_unknown_profile() -> None:
    res = _cli("--local", "--profile", "hopper-cu12")
    assert res.returncode == 2 and "unknown stack profile" in res.stderr
