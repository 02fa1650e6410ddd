"""The demo's soak trains stably whatever the machine and the seed: tiny-moe as `stepdeploy demo` renders its soak
(its --soak-iterations schedule, sequence, batch and learning rate; the BPE dataset it prepares from the docs) trained
by train.py as one real process (gloo, world 1: the demo's two data-parallel ranks split the same global batch), then
judged by the soak's own training gates. The iterations, not the step time, size the schedule
(test_rollout_pure.py: one schedule for step times from 0.01 to 30 s), so the outcome is the same on a fast and a
slow machine; the seeds stand for whatever else differs. More seeds: `pytest -m bench` (docs/benchmarks.md).

Before the fix the demo failed its soak's loss_spikes gate at iteration 51 on every machine (10.7 against a
median of 2.9): the torch engine read the byte-level corpus in order and met a box-drawing diagram whole. Later
(2026-12-06) a session's new tables of figures in docs/benchmarks-log.md gave a spike at iteration 54 on the demo's
seed (7.97 against 6.33): the demo reads the docs but the measurement logs (demo.DEMO_SKIPPED)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import stepdeploy.workload
from stepdeploy import corpus
from stepdeploy.catalog import load_model
from stepdeploy.cli import demo
from stepdeploy.plan.layout import Layout
from stepdeploy.render.options import RenderOptions
from stepdeploy.render.workload import workload_config
from stepdeploy.rollout import gates, training_gates
from stepdeploy.rollout.stages.soak import soak_schedule

pytest.importorskip("torch")
TRAIN = Path(stepdeploy.workload.__file__).parent / "train.py"


def _option(name: str) -> int:
    return int(demo.DEMO_ROLLOUT[demo.DEMO_ROLLOUT.index(name) + 1])


@pytest.fixture(scope="module")
def docs_corpus(tmp_path_factory: pytest.TempPathFactory) -> corpus.Corpus:
    return corpus.prepare(demo.demo_texts(), tmp_path_factory.mktemp("demo") / "corpus",
                          train_tokenizer=demo.DEMO_VOCAB)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train_demo_soak(tmp_path: Path, made: corpus.Corpus, seed: int) -> list[dict]:
    schedule = soak_schedule(30.0, 0.3, "measured in the warm-up", iterations=demo.SOAK_ITERATIONS)
    opts = RenderOptions(run_id="demo-soak", stage="soak", iterations=demo.SOAK_ITERATIONS,
                         seq_length=_option("--seq"), global_batch_size=_option("--gbs"), seed=seed,
                         warmup_iterations=schedule.warmup, decay_iterations=schedule.decay,
                         save_interval=demo.SOAK_ITERATIONS, pg_timeout_s=30)
    cfg = workload_config(load_model("tiny-moe"), Layout(mbs=2), opts, engine="torch", world=1, peak_tflops=None)
    cfg["data"] = made.workload_entry(str(made.prefix))
    (tmp_path / "workload.json").write_text(json.dumps(cfg))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1", "STEPDEPLOY_NODE_NAME": "here"}
    res = subprocess.run([sys.executable, str(TRAIN), "--config", str(tmp_path / "workload.json"), "--out-dir",
                          str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]


def _judge(metrics: list[dict]) -> list[gates.GateVerdict]:
    warmup = soak_schedule(30.0, 0.3, "", iterations=demo.SOAK_ITERATIONS).warmup
    return training_gates.soak_training_gates(metrics, warmup, gates.Thresholds())


@pytest.mark.parametrize("seed", [RenderOptions(run_id="x").seed])  # the demo's own seed
def test_the_demos_soak_passes_its_gates(tmp_path: Path, docs_corpus: corpus.Corpus, seed: int) -> None:
    metrics = train_demo_soak(tmp_path, docs_corpus, seed)
    assert [m["iteration"] for m in metrics] == list(range(1, demo.SOAK_ITERATIONS + 1))
    verdicts = _judge(metrics)
    assert {v.gate for v in verdicts} >= {"loss_trend", "loss_spikes", "grad_norm", "expert_load"}
    failed = [(v.gate, v.reason) for v in verdicts if not v.passed]
    assert failed == [], failed


@pytest.mark.bench
@pytest.mark.parametrize("seed", [1, 2, 3, 7, 11, 99])
def test_the_demos_soak_passes_its_gates_more_seeds(tmp_path: Path, docs_corpus: corpus.Corpus, seed: int) -> None:
    verdicts = _judge(train_demo_soak(tmp_path, docs_corpus, seed))
    assert [(v.gate, v.reason) for v in verdicts if not v.passed] == []


def test_the_demo_reads_the_docs_but_the_measurement_logs() -> None:
    texts = demo.demo_texts()
    names = [path.name for path in texts]
    assert names == sorted(names) and len(names) >= 10 and "rollout.md" in names
    assert not set(names) & set(demo.DEMO_SKIPPED)
    assert all((demo.DEMO_TEXT / name).is_file() for name in demo.DEMO_SKIPPED)  # they exist: left out, not missing
