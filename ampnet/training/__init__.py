"""Training: the step (forward, loss, backward, unscale, check, step, update), distributed training, what the user passes in, and checks of the module's output."""
