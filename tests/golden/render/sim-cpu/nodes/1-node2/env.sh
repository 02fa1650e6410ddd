# shellcheck shell=bash
# Rendered by stepdeploy 0.0.0-golden from templates/env.sh.j2 -- do not edit; render again.
# Environment of node "node2" (node rank 1); sourced by launch.sh.

# the run's identity; stop and poll find this run's processes by STEPDEPLOY_RUN_ID
export STEPDEPLOY_RUN_ID=golden-cpu
export STEPDEPLOY_RUN_DIR=/var/lib/stepdeploy/runs/golden-cpu
export STEPDEPLOY_NODE_NAME=node2
export STEPDEPLOY_NODE_RANK=1
# log lines reach the log file as they are printed
export PYTHONUNBUFFERED=1
# training interface of node2 (inventory stepdeploy_train_iface)
export NCCL_SOCKET_IFNAME=eth0
export GLOO_SOCKET_IFNAME=eth0
export UCX_NET_DEVICES=eth0
export OMPI_MCA_btl_tcp_if_include=eth0
# no RDMA fabric declared: NCCL uses sockets
export NCCL_IB_DISABLE=1
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
# CPU node: threads per rank
export OMP_NUM_THREADS=1
