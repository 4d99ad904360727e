"""Count the training steps whose gradients are not finite for the
benchmark's ResNet under CPU bf16 autocast, with a plain torch loop (no
ampnet), to see whether this machine's torch gives non-finite bf16
gradients (docs/user_guide/performance.md, "Non-finite bf16 gradients").

    python tools/bf16_grad_check.py            # bf16 autocast, fused AdamW
    python tools/bf16_grad_check.py --foreach  # foreach AdamW
    python tools/bf16_grad_check.py --float32  # no autocast

A step with a non-finite gradient is not taken, so that the next ones stay
comparable; run it several times: the count varies from run to run.
"""

import argparse

import torch
import torch.nn.functional as F

from ampnet_bench.config import BenchConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--foreach", action="store_true", help="foreach AdamW instead of fused")
    parser.add_argument("--float32", action="store_true", help="no autocast")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    wl = BenchConfig(workloads=("resnet",), quick=True).workload("resnet")
    data = wl.make_data(0)
    torch.manual_seed(0)
    model = wl.build_module(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not args.foreach)
    bad = steps = 0
    for _ in range(args.epochs):
        for i in range(0, len(data.X), 32):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.float32):
                loss = F.cross_entropy(model(data.X[i:i + 32]), data.y[i:i + 32])
            loss.backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
            steps += 1
            if finite:
                optimizer.step()
            else:
                bad += 1
    print(f"torch {torch.__version__}: {bad} of {steps} steps had non-finite gradients")


if __name__ == "__main__":
    main()
