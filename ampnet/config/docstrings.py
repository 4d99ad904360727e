"""The docstring section of the parameters that ampnet adds to skorch's nets."""

from __future__ import annotations

__all__ = ["AMP_DOC", "amp_doc"]

AMP_DOC = """
    amp_enabled : bool or 'auto' (default=False)
      Train and predict with automatic mixed precision. ``'auto'``: the
      fit's first steps alternate between float32 and mixed precision
      (every step a real, kept training step; nothing is copied), and the
      rest of the fit trains in the faster one (mixed precision only when
      it beats float32 by more than 5%). The choice is stored per machine
      and model (``AMPNET_CACHE_DIR``, else the user's cache folder;
      ``amp_autotune__cache=False`` turns it off), so later fits start
      with it. The record is the fitted attribute ``amp_autotune_``
      (``AmpNet(**net.amp_autotune_.params)`` pins the choice); the
      settings (``amp_autotune__steps``, ``__warmup``, ``__min_steps``,
      ``__margin``, ``__cache``, ``__timer``) are described in ``ampnet.auto``. With False the net
      trains as the skorch net it replaces, bitwise, except that a step
      with non-finite gradients is skipped (see ``amp_skip_nonfinite``).
      With AMP on, a ``torch.optim`` optimizer whose kernel is not set
      (``optimizer__fused``/``optimizer__foreach``) uses its fused kernel
      where torch has one that works for the device and parameter dtype
      (Adam, AdamW, SGD, Adagrad), else foreach
      (``ampnet.precision.kernels``).

    amp_dtype : str or torch.dtype (default='auto')
      The low-precision dtype: ``'float16'`` (``'fp16'``, ``'half'``),
      ``'bfloat16'`` (``'bf16'``), ``torch.float16``, ``torch.bfloat16``, or
      ``'auto'``: bfloat16 on CPUs and on CUDA GPUs of compute capability
      8.0+, float16 on older GPUs and on MPS. float16 uses loss scaling;
      bfloat16 does not.

    amp_level : str (default='mixed')
      ``'mixed'``: autocast over float32 weights. ``'pure'``: float32
      parameters are stored and computed in the low-precision dtype, except
      those of normalization layers (BatchNorm, LayerNorm, GroupNorm,
      InstanceNorm, RMSNorm) and of ``amp_fp32_modules``; the forward still
      runs under autocast. float16 keeps loss scaling.

    amp_master_weights : bool or 'compensated' (default=True)
      With ``'pure'``: the optimizer updates float32 master copies
      (``amp_master_params_``) and the low-precision weights are refreshed
      from them after each step; gradients are accumulated in float32.
      False (bfloat16 only): the optimizer updates the low-precision
      weights directly, and updates smaller than half a unit in their last
      place are lost. ``'compensated'``: no float32 copy; each
      low-precision weight keeps a compensation buffer of its own dtype
      (Kahan summation) that the optimizer steps, so small updates are
      kept; the buffers are optimizer state (saved with ``f_optimizer``).
      For torch.optim's SGD, Adam, AdamW, NAdam, RAdam, Adamax, Adagrad,
      Adadelta, RMSprop and Rprop, fused or not; with float16 only SGD and
      Rprop (the optimizer state is float16 too).

    amp_fp32_modules : selector, list of selectors or 'auto' (default=None)
      Modules that always compute in float32 (inputs cast up, autocast off
      inside, float32 weights in ``'pure'``). A selector is a module class,
      a glob pattern on the qualified module name (``'head'``,
      ``'blocks.*.attn'``) or a compiled regex matching the whole name.
      ``'auto'`` (alone or in the list): at the start of the first fit,
      one forward and backward pass on the first training batch finds the
      modules where activations or gradients overflow the low-precision
      range, and keeps them in float32 (``amp_layout_.auto_fp32_modules``).

    amp_modules : None, selector or list of selectors (default=None)
      None: the whole model runs in low precision. Otherwise only the
      selected modules do; the rest of the model and the loss run in
      float32. ``amp_fp32_modules`` wins where both select a module.

    memory_format : str (default='preserve')
      ``'channels_last'``: 4-D parameters, buffers and floating inputs use
      ``torch.channels_last`` strides.

    grad_scaler : class or instance (default=ampnet.GradScaler)
      The loss scaler; its settings are set with ``grad_scaler__*``
      parameters (``init_scale``, ``growth_factor``, ``backoff_factor``,
      ``growth_interval``, ``min_scale``, ``max_scale``, ``hysteresis``,
      ``dynamic``, ``enabled``). It is enabled for float16 only, unless
      ``grad_scaler__enabled`` says otherwise. ``torch.amp.GradScaler``
      works too (its own settings; no bounds or hysteresis; it costs a
      second host read per step, for the new scale). An instance is a
      hyper-parameter: the net trains a copy on its own device (disabled,
      with the instance's settings, where no loss scaling runs, so that
      one net serves a grid over ``amp_enabled`` or ``amp_dtype``). A
      float16 net refuses, with a ``ValueError`` at ``initialize()``, a
      scaler that cannot scale on its device instead of training
      unscaled: ``torch.amp.GradScaler('cuda')`` made on a machine
      without CUDA (torch disabled it and dropped its settings), and the
      CUDA-only ``torch.cuda.amp.GradScaler`` class on another device.

    gradient_accumulation_steps : int (default=1)
      Micro-batches whose gradients are summed before one optimizer step.
      Each micro-batch loss is divided by this number, so that the step
      matches one large batch.

    amp_max_consecutive_skips : int or None (default=50)
      Raise :class:`ampnet.exceptions.AmpDivergenceError` after this many
      skipped optimizer steps in a row, instead of skipping forever. None
      turns the check off.

    amp_skip_nonfinite : bool (default=True)
      Without loss scaling (bfloat16, or AMP off), skip and record an
      optimizer step whose gradients hold NaN or inf instead of writing
      them into the weights. Not applied on skorch's closure path: to
      optimizers that require a closure (LBFGS) and, without loss scaling,
      to optimizers outside ``torch.optim`` whose ``step`` takes an optional
      closure (an AmpWarning says so).

    batch_gather : bool (default=True)
      Where ``X`` and ``y`` are numpy arrays, torch tensors or dicts of
      them, and the net uses skorch's ``Dataset`` and torch's ``DataLoader``
      (``iterator_train__batch_size``, ``__shuffle``, ``__generator`` and
      ``__drop_last`` set as you like), gather each batch with one index
      per array instead of the ``DataLoader``'s row-by-row indexing and
      collation: the same batches, in the same order, from the same random
      streams (``ampnet.training.batches``). False: skorch's
      ``DataLoader``.

    data_on_device : bool, 'auto' or int (default='auto')
      On a CUDA device, with ``batch_gather``'s array path: ``'auto'`` moves
      the arrays to the device once per fit when they take at most a
      quarter of its free memory, and gathers each batch there (no copy,
      no host sync per batch); True always, an int when they take at most
      that many bytes; otherwise, and with False, each batch is gathered
      into pinned memory and copied ``non_blocking``, one batch ahead.
      Callbacks then receive batches on the device. No effect on a CPU.

    distributed : 'auto' or bool (default='auto')
      Data-parallel training with ``torch.distributed``: with an
      initialized process group (``'auto'``) or ``True``, the training
      forward pass runs through ``DistributedDataParallel``, training and
      validation data are split with a ``DistributedSampler``, losses and
      validation predictions are reduced so that every rank has the same
      history, and only rank 0 prints and writes checkpoints.
"""


_PARAMETERS = "    Parameters\n    ----------\n"
_ATTRIBUTES = "    Attributes\n    ----------"


def amp_doc(cls_doc: str | None) -> str:
    """The docstring of an ampnet net built from its skorch class's
    ``cls_doc``: ampnet's parameters (:data:`AMP_DOC`) first, then skorch's
    own parameters and attributes, and skorch's introduction last, under
    Notes.

    skorch's text takes some 220 lines before its parameters end: placed
    first, it hid the AMP parameters (``help(AmpNetClassifier)`` showed
    ``amp_enabled`` at line 225). skorch's text is kept whole, once, in one
    numpydoc ``Parameters`` section (a second one is an error for numpydoc).

    Parameters
    ----------
    cls_doc : str or None
      skorch's class docstring (numpydoc, indented by 4 spaces after its
      first line).

    Returns
    -------
    doc : str
      The text to append after the net's one-line summary: it starts with
      a newline, so that it reads the same after ``"...\n\n"`` and after
      ``"...\n\n    "``.
    """
    doc = cls_doc or ""
    intro, params, rest = doc, "", ""
    if _PARAMETERS in doc:
        intro, params = doc.split(_PARAMETERS, 1)
        if _ATTRIBUTES in params:
            params, rest = params.split(_ATTRIBUTES, 1)
            rest = _ATTRIBUTES + rest
    lines = intro.strip("\n").splitlines()
    if lines and not lines[0].startswith(" "):  # skorch's summary line, unindented in its docstring
        lines[0] = "    " + lines[0]
    # moved after the parameters: skorch's "the parameters listed below" are now above it
    intro = "\n".join(lines).rstrip().replace("parameters listed below", "parameters listed above")
    parts = [
        "\n    The AMP parameters come first below, then those of skorch's net, which it takes\n"
        "    unchanged; skorch's introduction to the net follows under Notes.\n",
        _PARAMETERS.rstrip("\n"),
        AMP_DOC.strip("\n") + "\n",
    ]
    if params.strip():
        parts.append(params.rstrip() + "\n")
    if rest.strip():
        parts.append(rest.rstrip() + "\n")
    if intro.strip():
        parts += ["    Notes\n    -----\n    From skorch's documentation of the net:\n", intro + "\n"]
    return "\n".join(parts)
