"""Per-module precision control and pure low-precision training
(placeholder: filled by the precision-control work)."""

__all__ = ["PrecisionControlMixin"]


class PrecisionControlMixin:
    """amp_level='pure', amp_fp32_modules, amp_modules, memory_format."""

    def _amp_grads_ready(self) -> None:
        """Called at a step boundary after backward, before unscaling."""

    def _amp_after_step(self) -> None:
        """Called after the optimizers stepped (or skipped) at a step boundary."""
