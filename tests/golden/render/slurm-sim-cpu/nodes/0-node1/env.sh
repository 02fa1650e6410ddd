# shellcheck shell=bash
# Rendered by stepdeploy 0.0.0-golden from templates/env.sh.j2 -- do not edit; render again.
# Environment of node "node1" (node rank 0); sourced by launch.sh.

# the run's identity; stop and poll find this run's processes by STEPDEPLOY_RUN_ID
export STEPDEPLOY_RUN_ID=golden-slurm-cpu
export STEPDEPLOY_RUN_DIR=/var/lib/stepdeploy/runs/golden-slurm-cpu
export STEPDEPLOY_NODE_NAME=node1
export STEPDEPLOY_NODE_RANK=0
# log lines reach the log file as they are printed
export PYTHONUNBUFFERED=1
# training interface of node1 (inventory stepdeploy_train_iface)
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
# torch.compile's caches in the run directory, not /tmp/torchinductor_<user> (world-writable,
# a predictable name): a restart of the run reuses the kernels compiled before it
export TORCHINDUCTOR_CACHE_DIR=/var/lib/stepdeploy/runs/golden-slurm-cpu/cache/inductor
export TRITON_CACHE_DIR=/var/lib/stepdeploy/runs/golden-slurm-cpu/cache/triton
# CPU node: threads per rank
export OMP_NUM_THREADS=1
