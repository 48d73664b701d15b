#!/usr/bin/env bash
# flashflex: 2 torchrun command(s) for plan plans/plan-4rank.json (4 processes).
# Run line N on host N, all at about the same time; the first host serves the c10d rendezvous.
# Each host runs its plan node's devices; local rank i drives the i-th of them in plan rank order.
# Template: launchers/torchrun.sh.tmpl (edit freely: double-brace fields are filled in as shell-quoted words, never put them inside quotes; the node block repeats per node).
# node 0: plan node node0 on 10.200.0.1: 3 processes, plan ranks 0,1,3
env PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}" TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}" GLOO_SOCKET_IFNAME=veth0 NCCL_SOCKET_IFNAME==veth0 torchrun --nnodes=2 --nproc-per-node=3 --node-rank=0 --rdzv-backend=c10d --rdzv-endpoint=10.200.0.1:29511 --rdzv-id=job7 --rdzv-conf=is_host=1 --max-restarts=0 --local-addr=10.200.0.1 -m flashflex_cli.runtime.training.worker --config runs/r1/config.json --plan-node node0
# node 1: plan node node1 on 10.200.0.2: 1 processes, plan ranks 2
env PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}" TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}" GLOO_SOCKET_IFNAME=veth1 NCCL_SOCKET_IFNAME==veth1 torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --rdzv-backend=c10d --rdzv-endpoint=10.200.0.1:29511 --rdzv-id=job7 --rdzv-conf=is_host=0 --max-restarts=0 --local-addr=10.200.0.2 -m flashflex_cli.runtime.training.worker --config runs/r1/config.json --plan-node node1
