"""Saving and loading a net's state: ``save_params``/``load_params`` with the
loss-scaler and RNG states, crash-safe writes and validation before load.

Precision change between save and load
--------------------------------------
The scaler file (``f_grad_scaler``) holds the state of the net's loss
scaler: the scale and its trackers for float16, an empty state when the
scaler is disabled (bfloat16, or AMP off). Parameters, optimizer and
history do not depend on the precision and always load. For the scaler
file (rows: the net that saved, columns: the net that loads):

================  ==================  ==================  ==================
saved \\ loaded   float16             bfloat16            off
================  ==================  ==================  ==================
float16           restored (1)        AmpWarning (2)      AmpWarning (2)
bfloat16          ValueError (3)      no-op (4)           no-op (4)
off               ValueError (3)      no-op (4)           no-op (4)
================  ==================  ==================  ==================

1. The scale, growth tracker and hysteresis streak come from the file; the
   loading net's own settings (``grad_scaler__*``) stay in force and an
   AmpWarning names each setting that differed in the file.
2. The file holds a scale that this net does not use (it has no loss
   scaling): the state is not loaded, and a warning says so.
3. An empty state cannot initialize an enabled scaler: ValueError naming the
   file, nothing is changed. Load without the file (``f_grad_scaler=None``)
   to start from the scaler's ``init_scale``.
4. Both sides have no scaler state: nothing to restore.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable

import torch
from skorch.callbacks import LRScheduler
from skorch.history import History
from skorch.utils import _check_f_arguments, get_map_location

from ampnet.io.atomic import atomic_write_group, is_path, recover, write_key
from ampnet.exceptions import amp_warn
from ampnet.io.layout import describe_target, attr_of, resolve_checkpoint, checkpoint_files
from ampnet.io.state_files import to_tensors, from_tensors, read_state, read_history, check_module_state
from ampnet.io.writers import plain, text_writer, state_writer
from ampnet.io.untrusted import KINDS, OPTIONAL_FILES, max_bytes
from ampnet.io.optimizer_state import check_optimizer_state
from ampnet.io.rng import get_rng_state, prepare_rng_state
from ampnet.io.rollback import Step, apply_all
from ampnet.precision import drop_compensation
from ampnet.precision import keep_kernels
from ampnet.precision import validate_scaler_state
from ampnet.io.schedulers import (
    dumps_lr_scheduler_states,
    plan_lr_schedulers,
    read_lr_scheduler_states,
)

__all__ = ["PersistenceMixin", "checkpoint_files", "resolve_checkpoint"]

#: Entries of a scaler state that are state, not settings.
_SCALER_TRACKERS = ("scale", "_growth_tracker", "_overflow_streak", "ampnet_scaler_version")

#: How the files that hold no module state are read (a net's own
#: ``torch_load_kwargs`` apply to the module, optimizer and criterion files).
_SAFE = MappingProxyType({"weights_only": True})

_MSG_INIT = (
    "Cannot {verb} state of an un-initialized model. Please initialize first by "
    "calling .initialize() or by fitting the model with .fit(...)."
)
_MSG_MODULE = (
    "You are trying to {verb} 'f_{{name}}' but for that to work, the net needs to "
    "have an attribute called 'net.{{name}}_' that is a PyTorch Module or Optimizer; make sure that "
    "it exists and check for typos."
)


def _check_distinct_targets(files: dict[str, Any]) -> None:
    """Refuse two ``f_*`` arguments that name one file (or one file object):
    the later write would replace the earlier one. A symbolic link is not
    the file it points to: a save replaces the link itself."""
    seen: list[tuple[str, Any]] = []
    for key, target in files.items():
        for other_key, other in seen:
            if is_path(target) and is_path(other):
                same = write_key(target) == write_key(other)
                if not same and not os.path.islink(target) and not os.path.islink(other):
                    same = os.path.exists(target) and os.path.exists(other) and os.path.samefile(
                        target, other
                    )
            else:
                same = target is other
            if same:
                raise ValueError(
                    f"save_params got the same file for {other_key}={_spelling(other)} and "
                    f"{key}={_spelling(target)}: the second would replace the first. Fix: "
                    "give each its own file name. Nothing was written."
                )
        seen.append((key, target))


def _spelling(target: Any) -> str:
    return repr(os.fspath(target)) if is_path(target) else repr(target)


class PersistenceMixin:
    """``save_params``/``load_params`` with the loss-scaler and RNG states,
    crash-safe writes, validation before load, and pickling that keeps the
    scaler coherent across devices.

    Mixed into :class:`ampnet.AmpNet`; see :meth:`save_params` and
    :meth:`load_params`.
    """

    # ---- saving ---------------------------------------------------------

    def save_params(
        self,
        f_params: Any = None,
        f_optimizer: Any = None,
        f_criterion: Any = None,
        f_history: Any = None,
        f_grad_scaler: Any = None,
        f_rng_state: Any = None,
        f_lr_schedulers: Any = None,
        f_pickle: Any = None,
        use_safetensors: bool = False,
        params_dtype: Any = "float32",
        **kwargs: Any,
    ) -> None:
        """Save the module parameters, optimizer, loss scaler, history and
        more, each to its own file; the files of one call replace their old
        versions together.

        Every path is written to a temporary file in its directory and
        renamed into place once all files of the call are complete, so a
        process killed at any moment leaves either all old files or all new
        ones (see ``ampnet.io.atomic``). Open file objects are written
        directly.

        Parameters
        ----------
        f_params : file-like object, str, None (default=None)
          Path of the module parameters. Pass ``None`` to not save.

        f_optimizer : file-like object, str, None (default=None)
          Path of the optimizer state. Pass ``None`` to not save.

        f_criterion : file-like object, str, None (default=None)
          Path of the criterion state. Pass ``None`` to not save.

        f_history : file-like object, str, None (default=None)
          Path of the history (JSON). Pass ``None`` to not save.

        f_grad_scaler : file-like object, str, None (default=None)
          Path of the loss-scaler state (``grad_scaler_.state_dict()``;
          empty for a disabled scaler). Pass ``None`` to not save.

        f_rng_state : file-like object, str, None (default=None)
          Path of the global RNG states (torch, CUDA where used, numpy,
          ``random``) that exact resume needs. Pass ``None`` to not save.

        f_lr_schedulers : file-like object, str, None (default=None)
          Path of the state of the running ``LRScheduler`` callbacks (JSON),
          which :class:`ampnet.callbacks.checkpoint.LoadInitState` restores. Pass
          ``None`` to not save.

        f_pickle : file-like object, str, None (default=None)
          Path of a pickle of the whole net. Pass ``None`` to not save.

        use_safetensors : bool (default=False)
          Save tensors with safetensors instead of ``torch.save``. The
          scaler and RNG states are stored as tensors then; the optimizer
          state cannot be (it holds Python values).

        params_dtype : str (default='float32')
          With ``amp_level='pure'``: ``'float32'`` writes float32 module
          weights (the master copies), ``'low'`` the weights as the module
          stores them (low precision, norm layers float32).

        **kwargs
          ``f_<name>`` for any other attribute ``<name>_`` with a
          ``state_dict``, as in skorch.

        Raises
        ------
        ValueError
          A state that safetensors cannot store, or two arguments that name
          the same file (``'a.pt'``, ``'./a.pt'``, a hard link to it); nothing
          is written then. A target that is a symbolic link is replaced by the
          new file; the file it pointed to is not written.

        OSError
          A write that fails (a full disk): it names the file and the cause,
          and the previous files are unchanged.
        """
        files = dict(
            f_params=f_params, f_optimizer=f_optimizer, f_criterion=f_criterion,
            f_history=f_history, f_grad_scaler=f_grad_scaler, f_rng_state=f_rng_state,
            f_lr_schedulers=f_lr_schedulers, f_pickle=f_pickle, **kwargs,
        )
        _check_f_arguments("save_params", **files)
        files = {key: val for key, val in files.items() if val is not None}
        if not files:
            if self.verbose:
                print("Nothing to save")
            return
        _check_distinct_targets(files)
        precision = self.__dict__.get("precision_")
        as_dtype = (
            precision.params_as(self.__dict__.get("module_"), params_dtype)
            if precision is not None else contextlib.nullcontext()
        )
        with as_dtype:  # float32 weights unless 'low'
            writers = {
                target: self._writer(key, target, use_safetensors) for key, target in files.items()
            }
        atomic_write_group(writers)

    def _writer(self, key: str, target: Any, safetensors: bool) -> Callable[[Any], None]:
        source = describe_target(key, target)
        if key == "f_history":
            history = self.history
            return history.to_file
        if key == "f_pickle":
            return self._pickle_writer
        if key == "f_rng_state":
            return state_writer(get_rng_state(), source, safetensors)
        if key == "f_lr_schedulers":
            return text_writer(dumps_lr_scheduler_states(self, source))
        attr = attr_of(key)
        if not self.initialized_:
            self.check_is_fitted([attr], msg=_MSG_INIT.format(verb="save"))
        state = self._get_module(attr, msg=_MSG_MODULE.format(verb="save")).state_dict()
        if attr == "module_":
            self._write_auto_choices(state)  # the choices of the autos go with the weights
        if key == "f_grad_scaler" and safetensors:
            state = to_tensors(state)
        return state_writer(state, source, safetensors)

    def _pickle_writer(self, target: Any) -> None:
        if is_path(target):
            with open(target, "wb") as f:
                pickle.dump(self, f)
        else:
            pickle.dump(self, target)

    # ---- loading --------------------------------------------------------

    def load_params(
        self,
        f_params: Any = None,
        f_optimizer: Any = None,
        f_criterion: Any = None,
        f_history: Any = None,
        f_grad_scaler: Any = None,
        f_rng_state: Any = None,
        f_lr_schedulers: Any = None,
        checkpoint: Any = None,
        use_safetensors: bool = False,
        **kwargs: Any,
    ) -> None:
        """Load what :meth:`save_params` saved; every file is read and
        checked before anything of the net is changed.

        State other than module parameters is always read safely: the
        scaler and RNG states with ``torch.load(..., weights_only=True)``
        (or safetensors), the history as JSON. Module and optimizer files
        use the net's ``torch_load_kwargs`` (``weights_only=True`` unless
        set otherwise).

        Loading a scaler state restores the scale and its trackers; the
        net's own scaler settings (``grad_scaler__*``) stay in force, and an
        :class:`.AmpWarning` names each setting that differed in the file.
        For loads across precisions (float16, bfloat16, off) see the table
        in ``ampnet.io.persistence``.

        Parameters
        ----------
        f_params, f_optimizer, f_criterion, f_history : file-like object, str, None (default=None)
          As in :meth:`skorch.net.NeuralNet.load_params`.

        f_grad_scaler : file-like object, str, None (default=None)
          Path of the loss-scaler state. Pass ``None`` to not load.

        f_rng_state : file-like object, str, None (default=None)
          Path of the global RNG states; they are restored. Pass ``None``
          to not load.

        f_lr_schedulers : file-like object, str, None (default=None)
          Path of the ``LRScheduler`` states; restored into the schedulers
          that are running (during training, e.g. from a callback), with an
          :class:`.AmpWarning` for the others. To resume a schedule, load
          through :class:`ampnet.callbacks.checkpoint.LoadInitState`.

        checkpoint : :class:`ampnet.callbacks.checkpoint.Checkpoint`, None (default=None)
          Load every file of this checkpoint (skorch's Checkpoint works
          too). Explicit ``f_*`` arguments override its files. A scaler,
          RNG or scheduler file that the checkpoint does not name (skorch's
          Checkpoint) or that does not exist (a checkpoint written before
          ampnet saved them) is skipped with an :class:`.AmpWarning`; any
          other missing file raises.

        use_safetensors : bool (default=False)
          Whether the files were saved with safetensors.

        **kwargs
          ``f_<name>`` for any other attribute ``<name>_``, as in skorch.

        Raises
        ------
        ValueError
          A file that cannot be read safely, does not match the net (keys,
          shapes, dtypes, parameter groups, optimizer hyper-parameters and
          state), holds NaN or inf weights, is another kind of file, or
          holds an invalid history, scheduler, scaler state (saved from a
          disabled scaler, partial, a scale that is NaN, zero, negative,
          infinite or outside float32's range, a field of the wrong type) or
          RNG state (each field checked against what numpy, torch and
          ``random`` accept). Also a journal in a file's directory that
          ampnet did not write. The message names the file and the field.
          Every file is checked before anything changes, and if applying
          still fails everything applied is rolled back: the net is left
          exactly as it was (parameters, optimizer, history, scaler, RNG).

        OSError
          A file that cannot be read (``FileNotFoundError`` when missing;
          for a checkpoint: any but the scaler, RNG and scheduler files).
        """
        files: dict[str, Any] = {}
        optional: set[str] = set()
        absent: list[str] = []
        if checkpoint is not None:
            if not self.initialized_:
                self.initialize()
            checkpoint = resolve_checkpoint(checkpoint)
            files = checkpoint_files(checkpoint, self)
            optional = set(OPTIONAL_FILES)
            absent = [name for name in OPTIONAL_FILES if not hasattr(checkpoint, name)]
        files.update(kwargs)
        explicit = dict(
            f_params=f_params, f_optimizer=f_optimizer, f_criterion=f_criterion,
            f_history=f_history, f_grad_scaler=f_grad_scaler, f_rng_state=f_rng_state,
            f_lr_schedulers=f_lr_schedulers,
        )
        for key, val in explicit.items():
            if val:
                files[key] = val
                optional.discard(key)
                if key in absent:
                    absent.remove(key)
        _check_f_arguments("load_params", **files)
        files = {k: v for k, v in files.items() if v is not None and k != "f_pickle"}
        if not files:
            if self.verbose:
                print("Nothing to load")
            return
        recover({os.path.dirname(os.path.abspath(v)) for v in files.values() if is_path(v)})
        if checkpoint is not None:
            files = self._drop_missing_checkpoint_files(files, optional, absent)
        if use_safetensors and "f_optimizer" in files:
            raise ValueError(
                "Cannot load f_optimizer with use_safetensors=True: safetensors stores only "
                "tensors, and an optimizer state holds Python values. Fix: load the "
                "optimizer without safetensors, or pass f_optimizer=None (for a checkpoint: "
                "Checkpoint(f_optimizer=None))."
            )
        steps = self._read_all(files, use_safetensors)
        apply_all(self, steps)
        for step in steps:
            if step.message:
                amp_warn(step.message)

    def _drop_missing_checkpoint_files(
        self, files: dict[str, Any], optional: set[str], absent: list[str]
    ) -> dict[str, Any]:
        missing = [k for k, v in files.items() if is_path(v) and not os.path.exists(v)]
        required = [k for k in missing if k not in optional]
        if required:
            names = ", ".join(f"{k}={os.fspath(files[k])!r}" for k in required)
            raise FileNotFoundError(
                f"The checkpoint is incomplete: {names} not found. Nothing was loaded. Fix: "
                "point the checkpoint to a complete one (dirname, fn_prefix), or pass "
                "f_<name>=None for the files it does not have."
            )
        notes = [
            f"{k} file {os.fspath(files[k])!r} does not exist, so {KINDS[k].consequence}"
            for k in missing
            if self._needs_file(k)
        ]
        notes += [
            f"it does not save {k} (a skorch Checkpoint?), so {KINDS[k].consequence}"
            for k in absent
            if self._needs_file(k)
        ]
        if notes:
            amp_warn(
                "Loading a checkpoint without ampnet's resume files (an older checkpoint?): "
                + "; ".join(notes) + ". Everything else was loaded. Fix: save checkpoints to resume "
                "from with ampnet.checkpoint.Checkpoint and load them with "
                "ampnet.checkpoint.LoadInitState (drop-in replacements of skorch's, which also save "
                "the loss scaler and the random state).",
            )
        return {k: v for k, v in files.items() if k not in missing}

    def _needs_file(self, key: str) -> bool:
        """Whether a missing optional checkpoint file loses state of this net."""
        if key == "f_grad_scaler":
            return self.grad_scaler_.is_enabled()
        if key == "f_lr_schedulers":
            return any(isinstance(cb, LRScheduler) for _, cb in self.callbacks_)
        return True

    def _read_all(self, files: dict[str, Any], safetensors: bool) -> list[Step]:
        """Read and check every file; return the steps that apply them."""
        modules: list[Step] = []
        late: list[Step] = []
        rng: list[Step] = []
        choices: list[Step] = []
        device = self.device
        map_location = None
        if any(k not in ("f_history", "f_rng_state", "f_grad_scaler") for k in files):
            map_location = get_map_location(self.device)
            device = self._check_device(self.device, map_location)
        for key, target in files.items():
            source = describe_target(key, target)
            if key == "f_history":
                rows = read_history(target, source)
                late.append(Step(source, lambda rows=rows: setattr(self, "history", History(rows))))
            elif key == "f_rng_state":
                state = read_state(target, source, safetensors, "cpu", _SAFE, max_bytes(key))
                rng.append(Step(source, prepare_rng_state(state, source).apply))
            elif key == "f_lr_schedulers":
                data = read_lr_scheduler_states(target, source)
                late.append(self._plan_schedulers(data, source))
            else:
                step, found = self._read_component(key, target, source, files, safetensors, map_location)
                modules.append(step)
                choices = choices if found is None else found

        late.extend(choices)  # after the module and optimizer states: they carry over

        def set_device() -> None:
            if device != self.device:
                self.device = device

        device_step = Step("the device", set_device)
        # the RNG last: nothing after it may draw random numbers
        return [device_step, *modules, *late, *rng]

    def _read_component(self, key: str, target: Any, source: str, files: dict[str, Any],
                        safetensors: bool, map_location: Any) -> tuple[Step, list[Step] | None]:
        """Read and check the state of a module, an optimizer or the grad
        scaler: (the step that loads it, the steps of the module's saved
        'auto' choices; None for anything but the module)."""
        attr = attr_of(key)
        if not self.initialized_:
            self.check_is_fitted([attr], msg=_MSG_INIT.format(verb="load"))
        obj = self._get_module(attr, msg=_MSG_MODULE.format(verb="load"))
        if key == "f_grad_scaler":
            state = read_state(target, source, safetensors, "cpu", _SAFE, max_bytes(key))
            return self._plan_grad_scaler(from_tensors(state) if safetensors else state, source), None
        load_kwargs = self.torch_load_kwargs or _SAFE
        state = read_state(target, source, safetensors, map_location, load_kwargs, max_bytes(key))
        choices = None
        if isinstance(obj, torch.nn.Module):
            check_module_state(obj, state, source, attr)
            if attr == "module_":
                choices = self._plan_auto_choices(state, source)
            stale = self._stale_compensation(attr, files)
            if stale:
                return self._plan_module_without_compensation(obj, state, source, stale), choices
        elif isinstance(obj, torch.optim.Optimizer):
            state = keep_kernels(obj, state)  # the net's fused/foreach, not the file's
            check_optimizer_state(obj, state, source, attr)
        return Step(source, lambda: obj.load_state_dict(state)), choices

    # ---- the autos' saved choices: the net, which knows the autos, supplies them ----

    def _write_auto_choices(self, state: Any) -> None:
        """Write the autos' choices into the module ``state`` being saved
        (the net's: :func:`ampnet.auto.write_choices`); here, none."""

    def _plan_auto_choices(self, state: Any, source: str) -> list[Step]:
        """The load steps for the choices saved with the module ``state``
        (the net's: :func:`ampnet.auto.plan_choices`); here, none."""
        return []

    def _stale_compensation(self, attr: str, files: dict[str, Any]) -> list:
        """Optimizers whose compensation buffers a load of ``attr`` alone
        makes stale (weights replaced, optimizer state not)."""
        precision = self.__dict__.get("precision_")
        if attr != "module_" or "f_optimizer" in files or precision is None:
            return []
        if not precision.settings.compensated:
            return []
        optimizers = [getattr(self, n + "_", None) for n in self._optimizers]
        return [o for o in optimizers if isinstance(o, torch.optim.Optimizer)]

    def _plan_module_without_compensation(self, module, state, source, optimizers) -> Step:
        def apply() -> None:
            module.load_state_dict(state)
            for optimizer in optimizers:
                drop_compensation(optimizer)

        return Step(source, apply)

    def _plan_schedulers(self, data: dict[str, Any], source: str) -> Step:
        apply, notes, _ = plan_lr_schedulers(self, data, source)
        message = (
            f"Learning-rate schedulers not restored from {source}: " + "; ".join(notes) + "."
            if notes else None
        )
        return Step(source, apply, message)

    def _plan_grad_scaler(self, state: Any, source: str) -> Step:
        """Check a scaler state against this net's scaler; return the step
        that loads it.

        See the table in ``ampnet.io.persistence`` for each precision pair.
        """
        scaler = self.grad_scaler_
        if not scaler.is_enabled():
            if isinstance(state, Mapping) and not state:
                # no scaler state on either side
                return Step(source, lambda: None)
            validate_scaler_state(state, source)
            policy = self.precision_policy_
            message = (
                f"{source} holds the state of an enabled loss scaler (scale "
                f"{float(plain(state['scale'])):g}), but this net trains in {policy.name} "
                "without loss scaling, so the scaler state was not loaded (everything "
                "else was). This is expected when switching from float16 to bfloat16 or "
                "float32; pass f_grad_scaler=None to load_params (for a resume: a Checkpoint with "
                "f_grad_scaler=None in the LoadInitState) to load without this warning."
            )
            return Step(source, lambda: None, message)
        validate_scaler_state(state, source)
        own = scaler.state_dict()
        settings = [k for k in own if k not in _SCALER_TRACKERS]
        notes = [
            f"{k}={plain(state[k])!r} in the file, {own[k]!r} in the net"
            for k in settings
            if k in state and plain(state[k]) != own[k]
        ]
        unknown = sorted(str(k) for k in state if k not in own)
        if unknown:
            notes.append(f"{unknown} in the file are not used by {type(scaler).__name__}")
        merged = {k: plain(v) for k, v in state.items() if k in own}
        merged.update({k: own[k] for k in settings})
        merged["scale"] = float(merged["scale"])
        low, high = own.get("min_scale"), own.get("max_scale")
        if low is not None and high is not None and not low <= merged["scale"] <= high:
            clamped = min(max(merged["scale"], low), high)
            notes.append(
                f"scale {merged['scale']:g} lies outside the net's [min_scale, max_scale] = "
                f"[{low:g}, {high:g}] and was clamped to {clamped:g}"
            )
            merged["scale"] = clamped
        message = (
            f"Loaded the loss scale from {source}; the net's own scaler settings stay in "
            "force (set them with set_params(grad_scaler__<name>=...)): " + "; ".join(notes) + "."
        )
        return Step(source, lambda: scaler.load_state_dict(merged), message if notes else None)
