#!/usr/bin/env bash
# The one-call GPU check: pytest -m gpu, host syncs per step, every model workload on CUDA in bf16 and
# fp16 with auto's choice; one Markdown report (ampnet-gpu-check.md), in at most 8 minutes on one H100.
# Arguments go to `python -m ampnet.benchmark --check` (e.g. --dry-run on a CPU-only machine, --report FILE,
# --budget-s SECONDS). See docs/user_guide/performance.md, "The one-call GPU check".
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m ampnet.benchmark --check "$@"
