"""The training workload, started on every rank by launch_ranks.py (or torchrun):
`train.py --config workload.json --out-dir DIR`.

Two engines, one protocol: `torch` (CPU, gloo, DDP; the simulated cluster and CI) and `megatron` (GPU,
megatron-core). Both write the same JSON-lines metrics, heartbeat and status files (metrics.py) and the same
atomic checkpoints (ckpt.py). The process-group timeout is always explicit (gloo's default is 30 minutes).

Exit codes: 0 done, 2 bad configuration, 3 a collective failed (a peer died or timed out), 143 stopped by
SIGTERM, 1 anything else. Standard library + torch only (+ megatron-core for the megatron engine): this
directory is shipped to the nodes as files, never imported from the stepdeploy package there.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

STARTED = time.time()  # before torch's import (seconds of a start's cost)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, also when run as a file

import torch.distributed as dist  # noqa: E402 (after STARTED)
from metrics import RankFiles, log  # noqa: E402

IMPORTED = time.time()  # torch imported: the rest of a start's "imports + process group" is the process group

EXIT_CONFIG, EXIT_COLLECTIVE, EXIT_TERM = 2, 3, 143
PR_SET_PDEATHSIG = 1


class Stopped(Exception):
    pass


def _on_term(signum: int, _frame: object) -> None:
    # A stop brings up to three SIGTERMs (the controller's, the launcher's, the parent-death one): later ones must
    # not interrupt the first one's exit record (the rank would then read as killed, not stopped).
    signal.signal(signum, signal.SIG_IGN)
    raise Stopped(f"signal {signal.Signals(signum).name}")


def die_with_parent() -> None:
    """The launcher starts workers in sessions of their own; if it dies, its workers must not live on."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="stepdeploy training workload (one rank)")
    parser.add_argument("--config", required=True, type=Path, help="workload.json written by stepdeploy render")
    parser.add_argument("--out-dir", required=True, type=Path, help="metrics, heartbeats, status, checkpoints")
    parser.add_argument("--engine", choices=["torch", "megatron"], help="override the config's engine")
    parser.add_argument("--iterations", type=int, help="override the number of iterations")
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict:
    cfg = json.loads(args.config.read_text())
    if cfg.get("format") != 1:
        raise ValueError(f"{args.config}: unknown workload config format {cfg.get('format')!r}")
    if args.engine:
        cfg["engine"] = args.engine
    if args.iterations:
        cfg["training"]["iterations"] = args.iterations
    cfg["config_dir"] = str(args.config.resolve().parent)  # relative paths in it (the dataset) start there
    return cfg


def init_distributed(cfg: dict) -> None:
    timeout = timedelta(seconds=cfg["pg_timeout_s"])
    if cfg["engine"] == "megatron":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


COLLECTIVE_SIGNS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
                    "processgroup", "pair.cc", "broken pipe", "watchdog")


def is_collective_failure(exc: BaseException) -> bool:
    """A backend error, or a RuntimeError whose message says a peer or the process group failed."""
    if isinstance(exc, dist.DistBackendError | dist.DistNetworkError):
        return True
    text = str(exc).lower()
    return any(sign in text for sign in COLLECTIVE_SIGNS)


def run(cfg: dict, out_dir: Path, files: RankFiles) -> int:
    if cfg["engine"] == "megatron":
        import engine_megatron

        return engine_megatron.train(cfg, out_dir, files)
    import engine_torch

    return engine_torch.train(cfg, out_dir, files)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    signal.signal(signal.SIGTERM, _on_term)
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    files = RankFiles(args.out_dir, rank)
    files.started(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0")))
    code, reason = 1, "unknown"
    try:
        try:
            cfg = load_config(args)
        except (OSError, ValueError, KeyError) as exc:
            code, reason = EXIT_CONFIG, f"bad configuration: {exc!r}"
            return code
        files.phase("start", STARTED)
        files.phase("imported", IMPORTED)
        init_distributed(cfg)
        files.phase("initialized")
        code = run(cfg, args.out_dir, files)
        reason = "finished"
    except Stopped as exc:
        code, reason = EXIT_TERM, f"stopped by {exc}"
    except RuntimeError as exc:
        if is_collective_failure(exc):
            code, reason = EXIT_COLLECTIVE, f"collective failed (a peer died or timed out): {exc}"
        else:
            code, reason = 1, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    except BaseException as exc:
        code, reason = 1, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        files.exited(code, reason)
        log(rank, f"exit {code}: {reason.splitlines()[0] if reason else ''}")
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
