"""Log diagnosis: known failure signatures in the text of a run's logs, each mapped to a cause and a fix.

SIGNATURES is in priority order, causes before consequences: a GPU that fell off the bus (XID 79) makes
its peers' collectives time out, so the XID is listed before the NCCL watchdog. Pure: text in, values out.

A run directory's log is appended to by every attempt that runs in it (the soak restarts in place), so the
controller writes an ATTEMPT_MARKER line before each launch and the diagnosis reads only the lines after the
last one (`attempt_lines`): an earlier attempt's cause is never reported as this one's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stepdeploy.monitor.parse_gpu import parse_xids
from stepdeploy.preflight.gpu import APPLICATION_XIDS, DRAIN_FIX, HARDWARE_XIDS


@dataclass(frozen=True)
class Signature:
    name: str
    pattern: re.Pattern[str]
    cause: str
    fix: str


@dataclass(frozen=True)
class Diagnosis:
    signature: str
    cause: str
    fix: str
    evidence: str  # the first line that matched
    count: int  # how many lines matched

    def to_json(self) -> dict:
        return {"signature": self.signature, "cause": self.cause, "fix": self.fix, "evidence": self.evidence,
                "count": self.count}


def _sig(name: str, pattern: str, cause: str, fix: str) -> Signature:
    return Signature(name, re.compile(pattern, re.IGNORECASE), cause, fix)


ATTEMPT_MARKER = "==== stepdeploy: a new attempt starts here"  # rollout/recovery.py writes it before a launch

DISK_FULL = "disk_full"
SIGNATURES = (
    _sig("xid", r"NVRM: Xid \(", "the GPU driver logged an XID error (see the code below)", DRAIN_FIX),
    _sig("ecc", r"uncorrectable ECC error encountered", "an uncorrectable GPU memory (ECC) error killed the kernel",
         DRAIN_FIX),
    _sig("nvidia_smi_failed", r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver",
         "the NVIDIA kernel module is not loaded (a kernel update without a DKMS rebuild, or the driver crashed)",
         "lsmod | grep nvidia; dkms status; modprobe nvidia (check dmesg for why it fails); reinstall the driver "
         "with `stepdeploy provision` or reboot into the kernel it was built for"),
    _sig(DISK_FULL, r"No space left on device|\bENOSPC\b|\[Errno 28\]|\berrno 28\b|size mismatch in put",
         "a node's disk (or its quota) is full: a write failed with ENOSPC (errno 28), or an upload arrived short "
         "(paramiko's `size mismatch in put`)",
         "free space on the node (`df -h` of its run and checkpoint directory): delete old runs or checkpoints, "
         "keep fewer checkpoints, or point --remote-dir at a larger disk; then `stepdeploy rollout resume`"),
    _sig("cuda_oom", r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory",
         "a rank ran out of GPU memory",
         "lower the micro-batch size, enable (more) activation recompute, raise TP/PP/EP, set "
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; compare with `stepdeploy plan`'s memory estimate"),
    _sig("illegal_address", r"an illegal memory access was encountered|CUDA error: misaligned address",
         "a CUDA kernel accessed invalid memory (a software bug, or corrupted state after a hardware fault)",
         "rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel; check the node's XIDs (13/31/43 name the GPU)"),
    _sig("nan_loss", r"\bloss\b[^\n]{0,40}?\b(nan|-?inf(inity)?)\b|found (nan|inf)|non-finite (loss|grad)",
         "the training diverged: the loss or the gradients became NaN/Inf",
         "restart from the last checkpoint with a lower learning rate or longer warmup; inspect the batch at "
         "that iteration; check bf16 overflow"),
    _sig("checkpoint_writer_died", r"checkpoint writer process \d+ died",
         "a rank's checkpoint writer process (megatron-core's persistent writer) died -- killed (SIGKILL: usually "
         "the kernel's OOM killer) or crashed -- while the rank depended on it: the rank exited at once (its save in "
         "flight is not committed; `latest` names the previous checkpoint)",
         "the log line names the signal or exit code; for SIGKILL, dmesg | grep -i -e oom -e 'Killed process' on "
         "the node (the writer holds a host copy of its rank's checkpoint shard: lower host memory use or add "
         "memory); then `stepdeploy rollout resume` (it resumes from `latest`); STEPDEPLOY_CKPT_WRITER=fork "
         "writes with a process forked per save instead"),
    _sig("ib_error", r"NET/IB\s*:.*(error|fail)|IBV_WC_\w+_ERR|transport retry counter exceeded|ibv_\w+ failed"
                     r"|NET/IB : Got completion",
         "an InfiniBand/RoCE queue pair failed after its retries (NCCL_IB_TIMEOUT 20, RETRY_CNT 7: ~34 s)",
         "ibstat / ibv_devinfo (PORT_ACTIVE?), the port's error counters, the cable; check NCCL_IB_HCA and "
         "NCCL_IB_GID_INDEX (RoCEv2 usually 3) against `stepdeploy preflight`"),
    _sig("gloo_connection", r"Connection reset by peer|Connection closed by peer|Gloo.*(timed out|timeout)"
                            r"|gloo.*Connection refused",
         "a CPU (gloo) collective lost its peer: the peer process died or the network between the nodes failed",
         "find the first rank that exited (`stepdeploy rollout status`); check the training interface "
         "(ip link, ping) and GLOO_SOCKET_IFNAME"),
    _sig("nccl_timeout", r"Watchdog caught collective operation timeout|collective operation timeout"
                         r"|ProcessGroupNCCL.*timed? ?out|NCCL watchdog",
         "a collective did not finish within the process-group timeout: a peer was stuck, dead or unreachable",
         "look for the first cause above (a dead or hung rank, an XID, a link down); the rank whose heartbeat "
         "stopped first is the one to inspect"),
    _sig("nccl_error", r"NCCL error|ncclSystemError|ncclInternalError|ncclRemoteError|ncclUnhandledCudaError",
         "NCCL reported a communication error",
         "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET; check the interfaces NCCL picked"),
    _sig("port_in_use", r"EADDRINUSE|address already in use",
         "the rendezvous port is taken on the node: another run is still there (often one whose controller was "
         "killed: its processes train on, detached, until `rollout resume` re-attaches or `rollout stop` ends them)",
         "stepdeploy rollout list / status to find it, then `stepdeploy rollout stop RUN` (or `stepdeploy run "
         "stop RUN_DIR`); `ss -ltnp` on the node names the process holding the port"),
    _sig("killed", r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)|\bKilled process \d+|oom-kill",
         "a worker was killed with SIGKILL (the kernel's OOM killer, an operator, or an injected fault)",
         "dmesg | grep -i -e oom -e 'Killed process' on the node; if it was the OOM killer, lower host memory use "
         "(data-loader workers, pinned memory) or add memory"),
    _sig("segfault", r"Segmentation fault|SIGSEGV|signal 11\b",
         "a process crashed (segmentation fault)",
         "get the native stack (faulthandler, gdb core); often a mismatched extension build (flash-attn, TE)"),
)


def _xid_detail(lines: list[str]) -> tuple[str, str]:
    codes = sorted({e.code for e in parse_xids("\n".join(lines))})
    hardware = [c for c in codes if c in HARDWARE_XIDS]
    application = [c for c in codes if c in APPLICATION_XIDS]
    if hardware:
        return f"hardware XID {', '.join(map(str, hardware))}: the GPU or its link failed", DRAIN_FIX
    if application:
        return (f"application-level XID {', '.join(map(str, application))}: the job's kernel faulted",
                "fix the job (illegal address, memory fault, timeout); the hardware is not suspect")
    return (f"XID {', '.join(map(str, codes))} (not in the lists: look it up in NVIDIA's XID catalog)",
            "read NVIDIA's XID catalog for the code; drain the node if it names hardware")


def attempt_lines(lines: list[str]) -> list[str]:
    """The lines after the last ATTEMPT_MARKER (every line when there is none: one attempt, or its own tail)."""
    last = max((i for i, line in enumerate(lines) if ATTEMPT_MARKER in line), default=-1)
    return lines[last + 1:]


def diagnose(text: str) -> list[Diagnosis]:
    """Every known signature in the text, in SIGNATURES' order (causes first)."""
    lines = text.splitlines()
    found = []
    for sig in SIGNATURES:
        hits = [line.strip() for line in lines if sig.pattern.search(line)]
        if not hits:
            continue
        cause, fix = _xid_detail(hits) if sig.name == "xid" else (sig.cause, sig.fix)
        found.append(Diagnosis(sig.name, cause, fix, hits[0][:300], len(hits)))
    return found
