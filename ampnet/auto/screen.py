"""The screen of ``amp_enabled='auto'``: before it builds and times candidate
copies, the probe compares one forward pass per low-precision dtype with
float32's, on the net's own module, and leaves out the dtypes that cannot
pay off on this machine.

Why: where a dtype is emulated (bfloat16 on a CPU without AVX512-BF16 or
AMX, float16 on most CPUs) its matrix products run 5-50 times slower than
float32's, and even with AVX512-BF16 but no AMX they may run slower than
float32's (measured on the benchmark's MLP: bf16 autocast 1.56x float32's
epoch time on such a CPU); timing whole training steps of such candidates
would cost more than the fit they are meant to speed up. A forward pass
whose time is more than :data:`SCREEN_SLOWER` times float32's cannot become
a training step faster than float32's by the probe's margin: the backward
pass runs the same products in the same dtype, about twice the forward's.

The forward passes run without gradients and with the module in eval mode
(no running statistics move, no dropout draws), on the first training
batch; the module's train/eval flags are restored. They go through the
probe's timer, with ``params`` holding ``'autotune_screen': True``, so an
injected timer decides the screen as it decides the rounds.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from skorch.dataset import unpack_data

from ampnet.precision import parse_amp_dtype

__all__ = ["SCREEN_SLOWER", "SCREEN_REPEATS", "screen_dtypes", "float32_forward"]

#: A dtype whose forward pass takes more than this many times float32's is
#: not measured further.
SCREEN_SLOWER = 1.5

#: Timed forward passes per dtype (after one untimed); the fastest counts.
SCREEN_REPEATS = 2


def _forward(net: Any, Xi: Any, dtype: torch.dtype | None, fit_params: Mapping[str, Any]) -> Callable[[], Any]:
    device_type = torch.device(net.device or "cpu").type

    def run() -> None:
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
            net.infer(Xi, **fit_params)

    return run


def float32_forward(net: Any, batch: Any, **fit_params: Any) -> Callable[[], None] | None:
    """The screen's float32 forward pass of ``net`` on ``batch``, as a
    callable: without gradients, in eval mode (the module's train/eval
    flags are restored after each call). The probe times it before each
    timed training step, as the reference that the candidates' steps are
    compared with round by round. None where ``net`` has no ``module_``
    or the forward pass raises."""
    module = net.__dict__.get("module_")
    if not isinstance(module, torch.nn.Module):
        return None
    Xi, _ = unpack_data(batch)
    run = _forward(net, Xi, None, fit_params)

    def forward() -> None:
        flags = [(m, m.training) for m in module.modules()]
        try:
            module.eval()
            run()
        finally:
            for m, training in flags:
                m.training = training

    try:
        forward()  # untimed: it must run
    except Exception:
        return None
    return forward


def screen_dtypes(
    net: Any,
    batch: Any,
    candidates: Sequence[Mapping[str, Any]],
    timer: Callable[[dict, Callable[[], Any]], float],
    **fit_params: Any,
) -> tuple[dict[str, float], float | None, float]:
    """The forward-pass time ratio to float32 of each low-precision dtype
    among ``candidates`` (constructor parameters; float32's first), by
    dtype name, e.g. ``{'bfloat16': 12.3}``; float32's fastest pass; and
    the seconds all passes took (the timer's, the untimed first passes
    counted at their dtype's fastest timed one).

    Parameters
    ----------
    net : AmpNet
      The initialized ``'auto'`` net, still in float32; nothing of it
      changes.

    batch : tuple
      The probe's batch (``(Xi, yi)``).

    candidates : sequence of dict
      The candidates to be measured.

    timer : callable
      The probe's timer, ``timer(params, step) -> seconds``.

    A dtype whose forward pass raises is left out of the result (its
    candidates' training steps then show the error); so is float32's
    failure, which the baseline's own steps raise.
    """
    firsts: dict[str, Mapping[str, Any]] = {}
    for params in candidates:
        if params.get("amp_enabled") and params.get("memory_format", "preserve") != "channels_last":
            firsts.setdefault(str(params.get("amp_dtype")), params)
    if not firsts or not candidates:
        return {}, None, 0.0
    module = net.__dict__.get("module_")
    if not isinstance(module, torch.nn.Module):
        return {}, None, 0.0
    Xi, _ = unpack_data(batch)
    flags = [(m, m.training) for m in module.modules()]
    baseline = {**candidates[0], "autotune_screen": True}
    ratios: dict[str, float] = {}
    fastest: float | None = None
    spent = 0.0
    try:
        module.eval()
        fp32 = _forward(net, Xi, None, fit_params)
        try:
            fp32()  # untimed
        except Exception:
            return {}, None, 0.0
        for name, params in firsts.items():
            low = _forward(net, Xi, parse_amp_dtype(name), fit_params)
            try:
                low()  # untimed
            except Exception:  # the candidates' own steps will say why (unhealthy)
                continue
            base, other = [], []
            for _ in range(SCREEN_REPEATS):  # interleaved, as the rounds
                base.append(float(timer(dict(baseline), fp32)))
                other.append(float(timer({**params, "autotune_screen": True}, low)))
            ratios[name] = min(other) / min(base) if min(base) > 0 else 1.0
            spent += sum(base) + sum(other) + min(other) + (min(base) if fastest is None else 0.0)
            fastest = min(base) if fastest is None else min(fastest, *base)
    finally:
        for m, training in flags:
            m.training = training
    return ratios, fastest, spent
