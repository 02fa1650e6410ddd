"""The hostile-node suite (issue 36 item 8), kept with the fuzz suite (tests/unit/fuzz: what a user types; here:
what a node writes). A real rollout runs on this module's own 2-node simulated cluster, over real SSH, while the
nodes are scripted to tamper with what they write, one case of each kind the issue names:

  records   bad lines appended to rank 0's metrics.jsonl and phases.jsonl (non-object lines, NaN, Infinity, an
            iteration of 1e12, nesting 5,000 deep, invalid UTF-8, missing keys), status and heartbeat files that
            break the schema, invalid UTF-8 in a log
  volume    a 20 MB line in metrics.jsonl (over the reader's line bound, under fetch's file limit)
  fetch     node2's `tar` replaced: its fetch archive is the CVE-2025-4517 symlink chain (built for the
            controller's destination), which escapes tarfile's data filter on this Python 3.11.7
  links     node1's run directory holds links to /etc/shadow and to / where fetch collects files
  host key  node2's known_hosts entry is node1's key: nothing is written on any node
  shared    the controller's run directory has its controller.lock planted as a link to a victim file

Every case asserts: no controller traceback, the exit code the docs give, the ledger's run in a final state
(never "running"), the bad data counted and reported as the node's fault, nothing written outside the run dir."""

from __future__ import annotations

import json
import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdeploy.ledger import Ledger
from stepdeploy.remote.node_executor import POLL_DEADLINE_S, NodeExecutor
from stepdeploy.remote.ssh import Endpoint
from stepdeploy.remote.transport import SshChannel
from stepdeploy.render.manifest import Manifest
from stepdeploy.sim.cluster import SimConfig

from .conftest import private_cluster, processes_of, stepdeploy_cli, swapped_host_key_inventory

SMALL = ["-m", "tiny-dense", "--stages", "soak", "--seq", "64", "--gbs", "4", "--checkpoint-interval", "3"]
FAST = [*SMALL, "--pg-timeout", "30"]
POLL_INTERVAL_S = NodeExecutor.poll_interval_s  # the follow loop's sleep between two polls over SSH
FINAL = ("passed", "failed", "stopped")
NESTED = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"
BAD_METRICS = [b"[1]", b'{"iteration": NaN, "loss": 1.0}', b'{"iteration": Infinity, "loss": 1.0}',
               b'{"iteration": 1e12, "loss": 1.0}', b'"a string"', NESTED, b'{"iteration": 5, "loss": "\xff\xfe"}',
               b"{}", b'{"iteration": 1, "pad": "' + b"x" * 20_000_000 + b'"}']
BAD_PHASES = [b'{"phase": "start"}', b"[1]", b'{"phase": "save", "time": NaN}']


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    with private_cluster(tmp_path_factory, "sdhostl", "10.94.0.0/24", 8094) as cfg:
        yield cfg


def channel(cfg: SimConfig, i: int) -> SshChannel:
    return SshChannel(f"node{i}", Endpoint(host=cfg.address(i), key_file=cfg.client_key, known_hosts=cfg.known_hosts))


def no_traceback(res: object) -> None:
    text = res.stdout + res.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in text, text[-4000:]


def listing(root: Path, skip: Path) -> set[str]:
    return {str(p) for p in root.rglob("*") if p != skip and skip not in p.parents}


class Tamper:
    """The hostile nodes: once the soak trains (rank 0 wrote metrics), node1 appends bad records and plants links,
    node2's `tar` sends the symlink chain for fetch. Runs in a thread beside the rollout."""

    def __init__(self, cfg: SimConfig, run: Path) -> None:
        self.cfg, self.run = cfg, run
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self._tamper()
        except BaseException as exc:  # the test reads it
            self.error = exc
        finally:
            self.done.set()

    def _tamper(self) -> None:
        manifest_path = self.run / "attempts" / "soak-target" / "manifest.json"
        deadline = time.monotonic() + 300
        while not manifest_path.exists():
            assert time.monotonic() < deadline, "the soak's attempt was never rendered"
            time.sleep(0.5)
        time.sleep(1)
        manifest = Manifest.of(json.loads(manifest_path.read_text()))
        run_dir = q(manifest.run_dir)
        node1, node2 = channel(self.cfg, 1), channel(self.cfg, 2)
        try:
            self._chain_on(node2, manifest)
            while not node1.run(f"test -s {run_dir}/out/metrics.jsonl", 30).ok:
                assert time.monotonic() < deadline, "rank 0 never wrote metrics"
                time.sleep(0.5)
            node1.put(b"\n".join(BAD_METRICS) + b"\n", "/root/bad-metrics")
            node1.put(b"\n".join(BAD_PHASES) + b"\n", "/root/bad-phases")
            log = q(f"logs/{manifest.nodes[0].dir.rsplit('/', 1)[-1]}.log")
            script = (f"cd {run_dir} && cat /root/bad-metrics >> out/metrics.jsonl && "
                      "cat /root/bad-phases >> out/phases.jsonl && "
                      "printf '%s' '{\"rank\": \"x\", \"state\": \"running\"}' > out/status/rank7.json && "
                      "printf '[1]' > out/status/rank8.json && "
                      "printf '%s' '{\"iteration\": 1e12, \"time\": NaN}' > out/heartbeat/rank7 && "
                      f"printf 'before \\377\\376 bad utf-8 \\303\\050 after\\n' >> {log} && "
                      "ln -sfn /etc/shadow logs/shadow-link && ln -sfn / out/root-link.json")
            ran = node1.run(script, 60)
            assert ran.ok, ran
        finally:
            node1.close()
            node2.close()

    def _chain_on(self, node2: SshChannel, manifest: Manifest) -> None:
        """node2's `tar` answers fetch with the CVE-2025-4517 chain aimed at the controller's destination."""
        from tests.unit.remote.test_fetch_extract import cve_2025_4517

        dest = self.run / "attempts" / "soak-target" / "fetched" / manifest.nodes[1].dir
        dest.parent.mkdir(parents=True, exist_ok=True)  # the chain is sized by the path limit where it lands
        node2.put(cve_2025_4517(dest), "/root/hostile.tar.gz")
        wrapper = ("#!/bin/sh\nfor a; do case \"$a\" in *fetch.tar.gz) cp /root/hostile.tar.gz \"$a\"; exit 0;; "
                   "esac; done\nexec REAL \"$@\"\n")
        ran = node2.run(f"real=$(command -v tar) && printf '%s' {q(wrapper)} | sed \"s|REAL|$real|\" "
                        "> /usr/local/bin/tar && chmod 755 /usr/local/bin/tar && "
                        "[ \"$(command -v tar)\" = /usr/local/bin/tar ]", 60)
        assert ran.ok, ran


def q(text: str) -> str:
    return shlex.quote(text)


def test_a_rollout_with_hostile_nodes_finishes_and_blames_them(cluster: SimConfig, tmp_path: Path) -> None:
    run = tmp_path / "hostile"
    before = listing(tmp_path, run)
    tamper = Tamper(cluster, run)
    tamper.thread.start()
    try:
        res = stepdeploy_cli("rollout", "run", "-i", str(cluster.inventory), *FAST, "--soak-duration", "40s",
                             "--run-dir", str(run), cwd=tmp_path, timeout=600)
    finally:
        tamper.done.wait(60)
        node2 = channel(cluster, 2)
        node2.run("rm -f /usr/local/bin/tar /root/hostile.tar.gz", 30)
        node2.close()
    assert tamper.error is None, tamper.error
    no_traceback(res)
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]  # passed, or a gate failed
    led = Ledger(run / "ledger.sqlite")
    assert led.run("hostile")["status"] in FINAL
    assert all(a["status"] in FINAL for a in led.attempts("hostile"))
    events = led.events("hostile")
    node_data = [e["data"] for e in events if e["kind"] == "node_data"]
    assert node_data, [e["kind"] for e in events]
    bad = {k: v for d in node_data for k, v in d["bad"].items()}
    metrics_bad = sum(v for k, v in bad.items() if k.endswith("metrics.jsonl"))
    phases_bad = sum(v for k, v in bad.items() if k.endswith("phases.jsonl"))
    assert metrics_bad >= len(BAD_METRICS) - 1, bad  # the invalid-UTF-8 line may be read with replacement
    assert phases_bad >= len(BAD_PHASES), bad
    refused = [r for d in node_data for r in d["fetch"]]
    assert any(r["node"] == "node2" and ("left out" in r["detail"] or not r["ok"]) for r in refused), refused
    assert any(r["node"] == "node1" and "left out" in r["detail"] for r in refused), refused  # the planted links
    # nothing outside the run directory, nothing of the chain outside node2's destination, no link landed
    assert listing(tmp_path, run) == before
    fetched = run / "attempts" / "soak-target" / "fetched"
    assert not [p for p in fetched.rglob("*") if p.is_symlink()]
    assert not [p for p in run.rglob("newfile") if "nodes" not in p.relative_to(fetched).parts[:1]]
    assert not (fetched / "flag").exists() and not (fetched / "nodes" / "flag").exists()
    # the poll counts the status/heartbeat files as node1's bad records; `run status` does not crash on them
    status = stepdeploy_cli("run", "status", str(run / "attempts" / "soak-target"), "-i", str(cluster.inventory),
                            "--json", cwd=tmp_path, timeout=120)
    no_traceback(status)
    assert status.returncode in (0, 1, 3), status.stdout + status.stderr
    assert "rank7" in status.stdout and "rank8" in status.stdout, status.stdout[-3000:]
    assert processes_of(cluster, "hostile-soak") == {"node1": "", "node2": ""}


def test_a_changed_host_key_on_node2_stops_the_rollout_before_anything_is_written(cluster: SimConfig,
                                                                                   tmp_path: Path) -> None:
    inventory = swapped_host_key_inventory(cluster, tmp_path)
    run = tmp_path / "hostkey"
    before = listing(tmp_path, run)
    res = stepdeploy_cli("rollout", "run", "-i", str(inventory), *FAST, "--soak-duration", "20s",
                         "--run-dir", str(run), cwd=tmp_path, timeout=300)
    no_traceback(res)
    assert res.returncode in (1, 3), res.stdout[-3000:] + res.stderr[-3000:]
    assert "node2" in res.stdout + res.stderr
    led = Ledger(run / "ledger.sqlite")
    assert led.run("hostkey")["status"] in FINAL
    assert listing(tmp_path, run) == before
    node1 = channel(cluster, 1)
    try:
        found = node1.run("ls -d /var/lib/stepdeploy/runs/hostkey* 2>/dev/null | wc -l", 30)
    finally:
        node1.close()
    assert found.ok and found.stdout.strip() == "0", found


def test_a_planted_controller_lock_link_is_refused_and_its_target_untouched(cluster: SimConfig,
                                                                             tmp_path: Path) -> None:
    run = tmp_path / "shared"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / "controller.lock").symlink_to(victim)
    res = stepdeploy_cli("rollout", "run", "-i", str(cluster.inventory), *FAST, "--soak-duration", "20s",
                         "--run-dir", str(run), cwd=tmp_path, timeout=300)
    no_traceback(res)
    assert res.returncode in (1, 2), res.stdout[-3000:] + res.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    assert (run / "controller.lock").is_symlink()


def test_a_silent_node_is_detected_while_its_link_is_down_not_when_it_returns(cluster: SimConfig,
                                                                             tmp_path: Path) -> None:
    """Issue 36 item 7: node2's link goes down for 60 s (no reset: its packets vanish). A poll used to wait on the
    silent node's SSH session until the link came back (75 s down blinded the controller for ~87 s); now each poll
    round ends within POLL_DEADLINE_S, and a silence shorter than the heartbeat timeout may be a blip the run rides
    out, so the loss is detected once node1's ranks have waited on node2 past the heartbeat timeout (or node2 has
    been silent that long): within the timeout and the polls that see it, while the link is still down. When node2
    returns with its flap recorded and the run down, the node-loss is re-classified as a link failure."""
    run = tmp_path / "silent"
    heartbeat_s, down_s = 20, 60
    # node1's last heartbeat comes before the link goes down; its age passes the timeout between two readings of
    # node1, which are one poll round (held up to POLL_DEADLINE_S by silent node2) and the interval apart, and the
    # round that reads it returns within POLL_DEADLINE_S: the timeout plus two rounds, under the 60 s down
    bound = heartbeat_s + 2 * (POLL_DEADLINE_S + POLL_INTERVAL_S)
    res = stepdeploy_cli("rollout", "run", "-i", str(cluster.inventory), *FAST, "--soak-duration", "60s",
                         "--heartbeat-timeout", f"{heartbeat_s}s", "--inject", f"link-down:node=last@15s,for={down_s}s",
                         "--run-dir", str(run), cwd=tmp_path, timeout=600)
    no_traceback(res)
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    led = Ledger(run / "ledger.sqlite")
    assert led.run("silent")["status"] in FINAL
    assert all(a["status"] in FINAL for a in led.attempts("silent"))
    events = led.events("silent")
    fired = [e["data"] for e in events if e["kind"] == "inject" and "spec" in e["data"]]
    detected = [e["data"] for e in events if e["kind"] == "detected"]
    assert len(fired) == 1 and detected, [(e["kind"], e["message"]) for e in events]
    assert (detected[0]["kind"], detected[0]["node"]) == ("node-loss", "node2"), detected[0]
    latency = detected[0]["time"] - fired[0]["time"]
    # not before: node2 silent under the timeout and node1's collectives (30 s) not failed are no evidence yet;
    # half the timeout leaves room for node1's last heartbeat coming an iteration or a save before the link went
    assert heartbeat_s / 2 < latency <= bound < down_s, f"the silent node was detected after {latency:.1f} s"
    classified = [e["message"] for e in events if e["kind"] == "classified"]
    assert classified and classified[0].startswith("re-classified as link: monitor: node2 "), classified
    assert processes_of(cluster, "silent-soak") == {"node1": "", "node2": ""}


def test_a_20_s_link_blip_the_run_rides_out_is_a_warning_not_a_restart(cluster: SimConfig, tmp_path: Path) -> None:
    """Issue 36 item 7: node2's link goes down for 20 s, under the 60 s heartbeat timeout. node1's ranks wait in their
    collectives (TCP's backoff after 20 s down can stall them ~33 s, so the process-group timeout is 90 s), node2 is
    silent to the controller, then everything answers and trains on. No poll may call that a failure: no detection,
    no restart, one attempt that passed, metrics after the link came back, and the flap recorded as a warning that
    the report shows."""
    from stepdeploy.report.summary import read_run, summarise

    run = tmp_path / "blip"
    down_s = 20
    res = stepdeploy_cli("rollout", "run", "-i", str(cluster.inventory), *SMALL, "--pg-timeout", "90",
                         "--soak-duration", "75s", "--heartbeat-timeout", "60s",
                         "--inject", f"link-down:node=last@15s,for={down_s}s", "--run-dir", str(run),
                         cwd=tmp_path, timeout=600)
    no_traceback(res)
    led = Ledger(run / "ledger.sqlite")
    events = led.events("blip")
    story = [(e["kind"], e["message"][:160]) for e in events]
    assert res.returncode in (0, 1), (story, res.stdout[-3000:] + res.stderr[-3000:])  # passed, or a training gate
    verdicts = {v["gate"]: v["passed"] for v in led.verdicts("blip")}
    assert verdicts.get("no_unrecovered_failure"), verdicts
    fired = [e["data"] for e in events if e["kind"] == "inject" and "spec" in e["data"]]
    assert len(fired) == 1, story
    assert not [e for e in events if e["kind"] in ("detected", "failure", "restart")], story
    assert [a["status"] for a in led.attempts("blip")] == ["passed"], story
    back = fired[0]["time"] + down_s
    assert [m for m in led.metrics("blip", "loss") if m["ts"] > back], "no metrics after the link came back"
    flaps = [e for e in events if e["kind"] == "monitor" and e["data"].get("kind") == "link"]
    assert flaps and all(e["data"]["severity"] == "warn" for e in flaps), story
    assert any(e["data"]["node"] == "node2" and "went down 1 time(s)" in e["message"]
               and "the run trained on" in e["message"] for e in flaps), story
    shown = summarise(read_run(led, "blip")).notable_events()
    assert any(e["id"] == flaps[0]["id"] for e in shown), [e["message"] for e in shown]
    assert processes_of(cluster, "blip-soak") == {"node1": "", "node2": ""}
