#!/usr/bin/env bash
# Launch the zarrckpt example training job (python -m zarrckpt.example.train) with torchrun.
#
#   deploy/torchrun.sh [--ckpt URL] [--dry-run] [TRAIN ARGS...] [-- TRAIN ARGS...]
#
# The checkpoint root comes from --ckpt or $ZARRCKPT_CKPT_URL (one of them is required); the
# job resumes from the latest committed checkpoint under it, whatever world size saved it.
# Every other argument goes to the training module unchanged (--steps, --save-every, --pp,
# --ep, --backend, ...). Storage credentials never go on the command line: s3fs / gcsfs use
# their own credential chains, and $ZARRCKPT_STORAGE_OPTIONS (a JSON object) reaches the
# training module through the environment.
#
# Rendezvous, from the environment:
#   NNODES          nodes, or MIN:MAX for an elastic job (c10d only)        default 1
#   NPROC_PER_NODE  processes per node          default: GPUs on the node (nvidia-smi), else 1
#   RDZV_ENDPOINT   host:port of a c10d rendezvous -> --rdzv-backend=c10d (nodes may restart)
#   RDZV_ID         c10d rendezvous id, the same on every node                default zarrckpt
#   MASTER_ADDR     static rendezvous host (rank-0 node) when RDZV_ENDPOINT is unset
#   MASTER_PORT     static rendezvous port                                    default 29500
#   NODE_RANK       this node's rank for static rendezvous                   default 0
#   MAX_RESTARTS    torchrun worker-group restarts before failing             default 0
#   SHUTDOWN_TIMEOUT  seconds torchrun gives its ranks after SIGTERM / SIGUSR1 before SIGKILL:
#                   the example saves the step it is at, then exits (keep it under the pod's
#                   terminationGracePeriodSeconds)                            default 50
#   TORCHRUN        launcher executable                                       default torchrun
#   ZARRCKPT_TRAIN_MODULE  module to run (same contract as the example)
#                                                         default zarrckpt.example.train
# One node without RDZV_ENDPOINT or MASTER_ADDR runs torchrun --standalone (a private
# rendezvous on a free local port).
#
# The exact command is printed before it runs: "+ torchrun ..." on stderr. With --dry-run it
# is printed on stdout, shell-quoted, and not run.
set -euo pipefail

usage() {
    # The comment block at the top of this file, without the "# ".
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
}

die() {
    printf 'torchrun.sh: %s\n' "$1" >&2
    exit 2
}

is_count() {
    [[ $1 =~ ^[1-9][0-9]*$ ]]
}

ckpt="${ZARRCKPT_CKPT_URL:-}"
dry_run=0
train_args=()
while (($# > 0)); do
    case "$1" in
        --ckpt)
            (($# >= 2)) || die "--ckpt needs a URL"
            ckpt="$2"
            shift 2
            ;;
        --ckpt=*)
            ckpt="${1#--ckpt=}"
            shift
            ;;
        --dry-run)
            dry_run=1
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        --)
            shift
            train_args+=("$@")
            break
            ;;
        *)
            train_args+=("$1")
            shift
            ;;
    esac
done
[[ -n "$ckpt" ]] || die "no checkpoint URL: pass --ckpt URL or set ZARRCKPT_CKPT_URL"

nnodes="${NNODES:-1}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    gpus=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if ((gpus > 0)); then NPROC_PER_NODE="$gpus"; else NPROC_PER_NODE=1; fi
fi
is_count "$NPROC_PER_NODE" || die "NPROC_PER_NODE must be a positive integer, not '$NPROC_PER_NODE'"
max_restarts="${MAX_RESTARTS:-0}"
[[ $max_restarts =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a non-negative integer, not '$max_restarts'"

cmd=("${TORCHRUN:-torchrun}")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    # Dynamic rendezvous: nodes find each other through the c10d store at RDZV_ENDPOINT and
    # get their node rank from it; a restarted node rejoins.
    [[ $nnodes =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES must be N or MIN:MAX, not '$nnodes'"
    cmd+=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
        --rdzv-id="${RDZV_ID:-zarrckpt}")
elif [[ $nnodes == 1 && -z "${MASTER_ADDR:-}" ]]; then
    cmd+=(--standalone --nnodes=1)
else
    # Static rendezvous: a fixed node count, each node told its rank.
    is_count "$nnodes" || die "NNODES must be a positive integer without RDZV_ENDPOINT, not '$nnodes'"
    [[ -n "${MASTER_ADDR:-}" ]] || die "NNODES=$nnodes needs MASTER_ADDR (static) or RDZV_ENDPOINT (c10d)"
    node_rank="${NODE_RANK:-0}"
    if ! [[ $node_rank =~ ^[0-9]+$ ]] || ((node_rank >= nnodes)); then
        die "NODE_RANK must be in [0, $nnodes), not '$node_rank'"
    fi
    cmd+=(--nnodes="$nnodes" --node-rank="$node_rank" --master-addr="$MASTER_ADDR"
        --master-port="${MASTER_PORT:-29500}")
fi
shutdown_timeout="${SHUTDOWN_TIMEOUT:-50}"
is_count "$shutdown_timeout" || die "SHUTDOWN_TIMEOUT must be a positive integer, not '$shutdown_timeout'"
# Preemption: torchrun forwards these signals to its ranks, which save the step they are at
# (CheckpointManager(save_on=...)) and exit; it waits SHUTDOWN_TIMEOUT seconds before SIGKILL.
cmd+=(--nproc-per-node="$NPROC_PER_NODE" --max-restarts="$max_restarts"
    --signals-to-handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" --shutdown-timeout="$shutdown_timeout"
    -m "${ZARRCKPT_TRAIN_MODULE:-zarrckpt.example.train}" --ckpt "$ckpt")
cmd+=(${train_args[@]+"${train_args[@]}"})

if ((dry_run)); then
    printf '%q' "${cmd[0]}"
    printf ' %q' "${cmd[@]:1}"
    printf '\n'
    exit 0
fi
{
    printf '+ %q' "${cmd[0]}"
    printf ' %q' "${cmd[@]:1}"
    printf '\n'
} >&2
exec "${cmd[@]}"
