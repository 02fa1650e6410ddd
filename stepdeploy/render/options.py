"""What a render is asked for beyond the plan: run identity, launcher policy, and the seed's options.

The seed blog post's launch settings are offered as named options so a user can reproduce it; each carries
what it really does, which the renderer prints next to the rendered value (or instead of it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from stepdeploy.errors import BadInput
from stepdeploy.executor_kinds import EXECUTOR_HELP, EXECUTOR_KINDS

NODE_PYTHON = "/opt/stepdeploy/venv/bin/python"
REMOTE_RUNS = "/var/lib/stepdeploy/runs"
# Matched with fullmatch: `$` alone would let a trailing newline through (and split an #SBATCH line).
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

# name -> (what it renders, what it really does)
SEED_OPTIONS: dict[str, tuple[str, str]] = {
    "nccl-algo-tree": (
        "NCCL_ALGO=Tree",
        "forcing Tree is rarely faster: it switches off NCCL's per-size choice between Ring, Tree, NVLS and "
        "CollNet, and Ring wins for large messages on few nodes; measure with the preflight NCCL bench first",
    ),
    "cuda-malloc-async": (
        "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync",
        "a valid allocator backend, but its memory statistics differ from the caching allocator's, so peak "
        "memory is not comparable with the planner's estimate; the default here is expandable_segments:True",
    ),
    "ib-timeout-22": (
        "NCCL_IB_TIMEOUT=22",
        "a real NCCL variable, but an exponent: 4.096 us x 2^22 = 17.2 s per retry, ~137 s with 7 retries "
        "before a queue pair errors, against ~34 s at the default 20 -- a failed link is noticed 4x later",
    ),
    "nccl-timeout-600": (
        "process-group timeout 600 s",
        "the seed's NCCL_TIMEOUT=600 is not an NCCL variable (NCCL ignores it); the collective timeout is the "
        "process-group timeout given to init_process_group, so 600 s is rendered there and NCCL_TIMEOUT is not",
    ),
}

DEFAULT_LR = 3e-3  # when neither --lr nor the catalog (training.lr) gives one: right for the tiny CPU models only
STAGE_ITERATIONS = {"warmup": 20, "scale": 200, "soak": 2000}


@dataclass(frozen=True)
class RenderOptions:
    run_id: str
    stage: str = "warmup"
    engine: str | None = None  # None: torch on CPU nodes, megatron on GPU nodes
    iterations: int | None = None  # None: the stage's default
    seq_length: int | None = None  # None: the model's
    global_batch_size: int | None = None
    nproc_per_node: int | None = None  # None: GPUs per node (1 on CPU nodes)
    remote_dir: str = REMOTE_RUNS
    python: str = NODE_PYTHON
    rendezvous: str = "static"  # static master (node rank = inventory order) or c10d
    master_port: int = 29500
    max_restarts: int = 0
    pg_timeout_s: int = 120
    heartbeat_timeout_s: int = 480
    save_interval: int = 0  # 0: a checkpoint only at the end
    keep_checkpoints: int = 2  # retention: the newest K committed checkpoints stay (workload/ckpt.py)
    lr: float | None = None  # None: the model's catalog lr, else DEFAULT_LR
    seed: int = 1234
    disable_nvls: bool = False
    seed_options: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    peak_tflops: float | None = None  # for MFU; None: the catalog's measured or derated peak
    threads_per_rank: int | None = None  # OMP_NUM_THREADS on CPU nodes
    executor: str | None = None  # an EXECUTOR_KINDS name (slurm adds sbatch.sh); None: the inventory's, else fabric
    data: str | None = None  # a dataset `stepdeploy data prepare` wrote (local prefix); None: synthetic tokens
    warmup_iterations: int | None = None  # None: a tenth of the iterations
    decay_iterations: int | None = None  # the cosine decay's end (None: the iterations)

    @property
    def launcher(self) -> str:
        """Who starts a node's ranks, under every executor: `ranks` (workload/launch_ranks.py: torchrun's static
        rendezvous without its torch import, about a second of every start and restart) or torchrun, kept for what
        only it does (a c10d rendezvous, restarting its own workers). Slurm runs launch_ranks.py too: srun
        --kill-on-bad-exit SIGKILLs every node's task ~50 ms after launch_ranks.py exits on its worker's death, so
        one poll may find the killed rank and its victims dead together (when that was all it had, the controller
        blamed the lowest rank: CI, 2026-12-06, and Slurm kept torchrun for its slower exit). The launcher now writes
        when it saw its node's first failure into that rank's status file before it exits, and the controller blames
        the earliest (monitor/classify.py)."""
        if self.rendezvous != "static" or self.max_restarts > 0:
            return "torchrun"
        return "ranks"

    def __post_init__(self) -> None:
        if not RUN_ID.fullmatch(self.run_id):
            raise BadInput(f"run id {self.run_id!r} must be 1-64 letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit")
        if self.stage not in STAGE_ITERATIONS:
            raise BadInput(f"unknown stage {self.stage!r}; use one of {', '.join(STAGE_ITERATIONS)}")
        if self.engine not in (None, "torch", "megatron"):
            raise BadInput(f"unknown engine {self.engine!r}; use torch or megatron")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise BadInput(f"learning rate {self.lr} must be a positive finite number")
        if self.peak_tflops is not None and not (math.isfinite(self.peak_tflops) and self.peak_tflops > 0):
            raise BadInput(f"peak TFLOP/s {self.peak_tflops} must be a positive finite number")
        if self.executor is not None and self.executor not in EXECUTOR_KINDS:
            raise BadInput(f"unknown executor {self.executor!r}; use {EXECUTOR_HELP}")
        if self.rendezvous not in ("static", "c10d"):
            raise BadInput(f"unknown rendezvous {self.rendezvous!r}; use static or c10d")
        unknown = [name for name in self.seed_options if name not in SEED_OPTIONS]
        if unknown:
            raise BadInput(f"unknown seed option {', '.join(unknown)}; known: {', '.join(SEED_OPTIONS)}")
        check_env(self.extra_env)
        if self.keep_checkpoints < 1:
            raise BadInput(f"--keep-checkpoints {self.keep_checkpoints}: at least 1 (the checkpoint a restart "
                           "resumes from)")
        if not 1 <= self.pg_timeout_s <= 86400:
            raise BadInput(f"process-group timeout {self.pg_timeout_s} s is out of range 1-86400")
        if not self.remote_dir.startswith("/"):
            raise BadInput(f"remote directory {self.remote_dir!r} must be an absolute path")
        if not self.python:
            raise BadInput("--python must name the Python on the nodes")

    @property
    def run_dir(self) -> str:
        return f"{self.remote_dir.rstrip('/')}/{self.run_id}"

    @property
    def effective_pg_timeout_s(self) -> int:
        return 600 if "nccl-timeout-600" in self.seed_options else self.pg_timeout_s

    @property
    def effective_iterations(self) -> int:
        return self.iterations or STAGE_ITERATIONS[self.stage]


def parse_env(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """`KEY=VALUE` strings -> pairs; the value may hold anything (it is quoted when rendered)."""
    result = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise BadInput(f"--env {pair!r}: use KEY=VALUE")
        result.append((key, value))
    check_env(tuple(result))
    return tuple(result)


# names that say a value is a secret: --env values land in rendered files (and a rollout's ledger)
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE)


def check_env(pairs: tuple[tuple[str, str], ...]) -> None:
    """--env pairs: variable names, and none that says it holds a secret (render's and a rollout's, before their
    run directory or ledger exists)."""
    bad_keys = [key for key, _ in pairs if not ENV_KEY.fullmatch(key)]
    if bad_keys:
        raise BadInput(f"--env {bad_keys[0]!r} is not an environment variable name; use KEY=VALUE "
                       "with KEY made of letters, digits and '_'")
    secret = next((key for key, _ in pairs if SECRET_NAME.search(key)), None)
    if secret is not None:
        raise BadInput(f"--env {secret}: its name says it holds a secret, and --env values are written into the "
                       "rendered env.sh (and a rollout's ledger)",
                       hint="give the nodes secrets another way: their own environment or a file only the run's "
                            "user can read")
