#!/bin/sh
# The docker-compose cluster as plain processes on loopback: an S3 server (SeaweedFS), two nodes
# each running launch/node.sh (a torchrun agent with 2 workers, c10d rendezvous), one node
# SIGKILLed mid-run with all its workers, the job restarted, and every rank's loss compared bit
# for bit with an uninterrupted run of the same cluster. Exit status 0 only when identical.
#
#   launch/cluster.sh [--workdir DIR] [--kill-after-step N] [--kill-node 1] [--local-tier [--replace-node]]
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" launch/cluster.py "$@"
