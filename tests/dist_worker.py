"""One process of the distributed tests (launched by tests/test_distributed.py).

usage: dist_worker.py RANK WORLD PORT OUTDIR BATCH ACCUM [PRECISION [INIT_PARAMS]]
WORLD=1 runs without a process group (the single-process reference).
PRECISION: fp16 (default; with loss scaling), bf16, pure (bf16 weights with
fp32 masters), compensated (bf16 weights with bf16 compensation), off, or auto
(amp_enabled='auto' measuring in its steps, with a timer that makes mixed
precision faster on rank 0 and slower on every other rank). INIT_PARAMS: a
params file to load before training.
"""

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from skorch.callbacks import Checkpoint

from ampnet import AmpNetClassifier

torch.set_num_threads(1)
rank, world, port, outdir, batch, accum = sys.argv[1:7]
rank, world, batch, accum = int(rank), int(world), int(batch), int(accum)
precision = sys.argv[7] if len(sys.argv) > 7 else "fp16"
init_params = sys.argv[8] if len(sys.argv) > 8 else None
AMP = {
    "fp16": dict(amp_enabled=True, amp_dtype="float16", grad_scaler__init_scale=256.0,
                 grad_scaler__growth_interval=2),
    "bf16": dict(amp_enabled=True, amp_dtype="bfloat16"),
    "pure": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure"),
    "compensated": dict(amp_enabled=True, amp_dtype="bfloat16", amp_level="pure",
                        amp_master_weights="compensated"),
    "off": dict(amp_enabled=False),
    "auto": dict(amp_enabled="auto", amp_autotune__cache=False, amp_autotune__warmup=0, amp_autotune__min_steps=0,
                 amp_autotune__timer=lambda params, s: (0.5 if rank == 0 else 2.0) if params["amp_enabled"] else 1.0),
}[precision]
if precision == "auto":  # it measures bfloat16 on any CPU (tests/conftest.py's native_bf16, in this process)
    import ampnet.auto.enabled

    ampnet.auto.enabled.cpu_has_native_bf16 = lambda: True


class Poisoned(torch.nn.Module):
    """Linear model; on the third training forward of rank 0 only, its output's gradient becomes
    inf (a finite loss whose backward pass overflows: the loss scale backs off)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(6, 8)
        self.out = torch.nn.Linear(8, 2)
        self.calls = 0

    def forward(self, X):
        out = self.out(torch.tanh(self.hidden(X)))
        if self.training:
            self.calls += 1
            first_rank = not dist.is_initialized() or dist.get_rank() == 0
            if self.calls == 3 and first_rank and precision == "fp16":
                out = out.clone()
                out.register_hook(lambda g: g * float("inf"))
        return out


if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

rng = np.random.RandomState(0)
X = rng.randn(70, 6).astype(np.float32)
y = (X[:, 0] - X[:, 1] > 0).astype(np.int64)

torch.manual_seed(0)
net = AmpNetClassifier(
    Poisoned,
    criterion=torch.nn.CrossEntropyLoss,
    optimizer=torch.optim.SGD,
    lr=0.2,
    max_epochs=3,
    batch_size=batch,
    gradient_accumulation_steps=accum,
    iterator_train__shuffle=False,
    verbose=1,
    callbacks=[Checkpoint(dirname=f"{outdir}/checkpoint_{precision}_world{world}_rank{rank}")],
    **AMP,
)
net.initialize()
if init_params:
    net.load_params(f_params=init_params)
reductions = []
if world > 1:
    def counting_hook(state, bucket):
        reductions.append(1)
        return default_hooks.allreduce_hook(None, bucket)

    net.parallel_.ddp.register_comm_hook(None, counting_hook)
start_params = {k: v.detach().clone() for k, v in net.module_.state_dict().items()}
net.partial_fit(X, y)

history = [{k: v for k, v in row.items() if k != "dur"} for row in net.history]
for row in history:
    row["batches"] = [dict(b) for b in row["batches"]]
torch.save(
    {
        "params": {k: v.detach().clone() for k, v in net.module_.state_dict().items()},
        "history": history,
        "scale": net.grad_scaler_.get_scale(),
        "reductions": len(reductions),
        "start_params": start_params,
        "ddp": net.parallel_.ddp is not None,
        "param_dtypes": sorted({str(p.dtype) for p in net.module_.parameters()}),
        "auto": net.amp_autotune_.params if precision == "auto" else None,
        "compensation": {
            n: net.optimizer_.state[p]["ampnet_compensation"].clone()
            for n, p in net.module_.named_parameters()
            if "ampnet_compensation" in net.optimizer_.state.get(p, {})
        },
    },
    f"{outdir}/{precision}_rank{rank}_world{world}.pt",
)
if rank == 0:
    net.save_params(f_params=f"{outdir}/{precision}_params_world{world}.pt")
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
