#!/usr/bin/env bash
# The one-call GPU check: the workloads sized for a GPU (ResNet-50, a BERT-base-sized encoder, a
# GPT-2-small-sized decoder) and the overhead workload first, host syncs per step, pytest -m gpu, then as
# time allows every model workload in bf16 and fp16, with auto's choice; one Markdown report
# (ampnet-gpu-check.md) that opens with the targets, within a 450 s budget.
# Arguments go to `python -m ampnet.benchmark --check` (e.g. --dry-run on a CPU-only machine, --report FILE,
# --budget-s SECONDS). See docs/user_guide/performance.md, "The one-call GPU check".
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m ampnet.benchmark --check "$@"
