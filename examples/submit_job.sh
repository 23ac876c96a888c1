#!/usr/bin/env bash
# Submit a ray_ddp training run to a running Ray cluster as a Ray job, and wait for it.
#
#   RAY_ADDRESS=http://HEAD:8265 STORAGE=s3://bucket/runs bash examples/submit_job.sh [flags]
#
# RAY_ADDRESS  the cluster's dashboard (job server) address (required)
# STORAGE      where checkpoints and metrics go: a path every node sees, or a URI
# NAME         the run's name (the same name resumes); default: job-<time>
# Extra arguments are `ray-ddp train` flags. The job's working directory is this folder,
# so `--model my_model:build` imports examples/my_model.py on every node. With token
# authentication (Ray 2.60's default) the token must be in RAY_AUTH_TOKEN or ~/.ray/auth_token.
# Exits 0 when the job SUCCEEDED, 1 when it FAILED (as `ray job submit` does).
set -euo pipefail
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://127.0.0.1:8265}"
STORAGE="${STORAGE:-/tmp/ray_ddp_runs}"
NAME="${NAME:-job-$(date +%Y%m%d-%H%M%S)}"
HERE="$(cd "$(dirname "$0")" && pwd)"

exec ray job submit --address "$RAY_ADDRESS" --working-dir "$HERE" -- \
    ray-ddp train --storage "$STORAGE" --name "$NAME" "$@"
