# shellcheck shell=bash
# Rendered by stepdeploy 0.0.0-golden from templates/env.sh.j2 -- do not edit; render again.
# Environment of node "spark-1" (node rank 1); sourced by launch.sh.

# the run's identity; stop and poll find this run's processes by STEPDEPLOY_RUN_ID
export STEPDEPLOY_RUN_ID=golden-spark
export STEPDEPLOY_RUN_DIR=/var/lib/stepdeploy/runs/golden-spark
export STEPDEPLOY_NODE_NAME=spark-1
export STEPDEPLOY_NODE_RANK=1
# log lines reach the log file as they are printed
export PYTHONUNBUFFERED=1
# training interface of spark-1 (inventory stepdeploy_train_iface)
export NCCL_SOCKET_IFNAME=enp1s0f1np1
export GLOO_SOCKET_IFNAME=enp1s0f1np1
export UCX_NET_DEVICES=enp1s0f1np1
export OMPI_MCA_btl_tcp_if_include=enp1s0f1np1
# RDMA devices of the inventory, exact match; on a DGX Spark both halves of the port
export NCCL_IB_HCA='=rocep1s0f1,roceP2p1s0f1'
# 4.096 us x 2^20 = 4.3 s per retry
export NCCL_IB_TIMEOUT=20
# retries before a queue pair errors (~34 s in all at NCCL_IB_TIMEOUT 20)
export NCCL_IB_RETRY_CNT=7
# a failed or timed-out collective tears the process down instead of hanging
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
# torch's NCCL watchdog: kill a rank whose collectives made no progress for this long
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=480
# torch.compile's caches beside the runs, not /tmp/torchinductor_<user> (world-writable, a
# predictable name), shared by the runs on this node: a restart, and every stage after the
# first, reuse the kernels compiled before (on an H200 a warm cache cut the dense proxy's
# first step from 14.0 s to 5.3 s: docs/benchmarks.md)
export TORCHINDUCTOR_CACHE_DIR=/var/lib/stepdeploy/runs/.compile-cache/inductor
export TRITON_CACHE_DIR=/var/lib/stepdeploy/runs/.compile-cache/triton
# torch's CPU allocator asks for transparent huge pages for blocks of 2 MiB and more: a
# checkpoint read, which fills fresh host memory twice per tensor, page-faults 512x less (a
# 2 GiB torch DCP read 2.4-2.7 s -> 1.2-1.3 s on a CPU: docs/benchmarks.md)
export THP_MEM_ALLOC_ENABLE=1
# fewer fragmentation OOMs with changing shapes (MoE routing)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# inductor's load-time halving of a reduction kernel's block adds a second config that is
# benchmarked again at every process start, warm cache or not (pytorch/pytorch#189121):
# on an H200 the dense proxy's first step after a restart 5.78 s -> 2.75 s, kill to first
# new step 21.0 -> 17.7 s, the steady step unchanged (0.626/0.627 s): docs/benchmarks.md
export TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0
