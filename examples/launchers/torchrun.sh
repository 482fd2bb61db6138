#!/usr/bin/env bash
# An external GeoFP8 job under torchrun on one node (docs/launchers.md): one attach-only worker
# per local rank, then torchrun as usual with GEOFP8_JOB and the hook sockets in its environment.
# Usage: examples/launchers/torchrun.sh COORDINATOR_ADDRESS [NPROC]   (after `geofp8ctl submit -f
# examples/jobs/external-2.yaml`). Set GEOFP8_TOKEN_FILE when the coordinator has a token.
set -euo pipefail
coordinator=${1:?usage: torchrun.sh COORDINATOR_ADDRESS [NPROC]}
nproc=${2:-2}
job=${GEOFP8_JOB:-external-2}
run=${XDG_RUNTIME_DIR:-/tmp}/geofp8-$job
mkdir -p "$run"
token=()
[ -n "${GEOFP8_TOKEN_FILE:-}" ] && token=(--token-file "$GEOFP8_TOKEN_FILE")
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for ((i = 0; i < nproc; i++)); do
  geofp8-worker --coordinator "$coordinator" --name "$(hostname):$i" --attach "$run/hook.$i.sock" \
    --data-dir "$run/worker.$i" --metrics-port $((9465 + i)) "${token[@]}" &
  pids+=("$!")
done
# A store per torchrun restart: with the one torchrun shares by default, a restarted rank can read
# its dead peer's Gloo address and fail in init_process_group (docs/launchers.md).
GEOFP8_JOB=$job GEOFP8_HOOK_ADDRESS="unix:$run/hook.{local_rank}.sock" \
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
  torchrun --standalone --nproc-per-node "$nproc" --max-restarts 3 \
  examples/pytorch/train_gpt.py --steps 200 --checkpoint-every 20 --checkpoint-dir "$run/ckpt"
