#!/bin/sh
# One node of the cluster: a torchrun agent with $NPROC_PER_NODE workers that joins $NNODES nodes
# by c10d rendezvous at $RDZV_HOST:$RDZV_PORT and trains launch/train.py, checkpointing to
# $CKPT_URL and logging losses under $LOSS_LOG. Used as is by docker/compose.yaml and by
# launch/cluster.sh; the settings live in docker/cluster.env. Extra arguments go to train.py.
set -eu
cd "$(dirname "$0")/.."
: "${RDZV_ID:=distckpt-cluster}"
# Two tiers (optional): LOCAL_DIR is this node's local tier, every DURABLE_EVERY-th save also to S3.
: "${LOCAL_DIR:=}"
: "${DURABLE_EVERY:=10}"
# The memory tier (optional): MEMORY_TIER=1 also commits every save to this node's /dev/shm and
# each node's ranks' files to a partner node (docker/compose.memory.yaml sets it).
: "${MEMORY_TIER:=}"
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$RDZV_ID" \
    --max-restarts "$MAX_RESTARTS" --monitor-interval 0.5 \
    launch/train.py --ckpt "$CKPT_URL" --loss-log "$LOSS_LOG" --steps "$STEPS" \
    --ckpt-every "$CKPT_EVERY" --batch "$BATCH" \
    ${LOCAL_DIR:+--local-dir "$LOCAL_DIR" --durable-every "$DURABLE_EVERY"} ${MEMORY_TIER:+--memory-tier} "$@"
