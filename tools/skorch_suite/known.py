"""Classified differences: skorch tests that fail with ampnet but pass with
plain skorch, and why. ``compare.py`` labels each ampnet-only failure with
the first matching entry; a failure with no entry is UNCLASSIFIED.

Categories:
  a  a bug in ampnet (to be fixed; the entry goes when the fix lands)
  b  an intended difference, to be documented
  c  the test checks an implementation detail of skorch's classes

Test ids are as in the JUnit files: ``tests.test_net.TestNeuralNet::test_x[param]``.
Classified against ampnet 4de018e and f8623f2 (HEAD while the harness was
written); entries name the file to fix.
"""

from __future__ import annotations

import re

CLASS_NAME = (
    r"::(test_not_init_raises\[\w+\]|test_not_fitted_raises|test_repr_(uninitialized|initialized|fitted)_works"
    r"|test_pass_empty_classes_raises\[\w+\]|test_error_when_classes_could_not_be_inferred)$"
)
CUSTOM_DEVICE = r"test_net\.TestNeuralNet::test_(moving_custom_modules_to_device|set_params_on_custom_module_preserves_its_device)$"

#: (regex searched in the test id, modes, category, explanation)
KNOWN: list[tuple[str, tuple[str, ...], str, str]] = [
    (
        CLASS_NAME, ("off", "on"), "c",
        "asserts the literal class name/path 'NeuralNetClassifier' / "
        "'skorch.classifier.NeuralNetClassifier' in repr and error messages; skorch "
        "builds them from type(self), so they name AmpNet*. Apart from that line the "
        "repr and messages are identical.",
    ),
    (
        r"test_net\.TestNeuralNet::test_accumulator_that_returns_last_value$", ("off", "on"), "b",
        "ampnet calls optimizer.step() without a closure unless step() requires one "
        "(utils.needs_closure); skorch always passes the closure. A custom optimizer "
        "whose step(closure=None) evaluates the closure gets None, and "
        "get_train_step_accumulator is used only on the closure path. Workaround: "
        "declare step(self, closure) without a default.",
    ),
    (
        CUSTOM_DEVICE, ("off",), "a",
        "resolve_precision() parses `device` with torch.device() even when "
        "amp_enabled=False, so a device skorch accepts (anything .to() takes; the "
        "test uses a fake 'foo') raises ValueError at initialize().",
    ),
    (
        r"test_net\.TestNeuralNet::test_custom_non_default_module_with_check_is_fitted$", ("off", "on"), "a",
        "precision_control._amp_apply_layout() reads self.module_ unconditionally "
        "(via _amp_root); skorch supports nets whose module is not called module_ "
        "(skorch #927), so initialize() raises AttributeError.",
    ),
    (
        r"test_net\.TestNeuralNet::test_save_params_not_init_optimizer$", ("off", "on"), "a",
        "precision_control._amp_apply_layout() needs precision_policy_, which only "
        "AmpNetMixin.initialize() sets; skorch's _initialize_module() called on its own "
        "(partial initialization) raises AttributeError.",
    ),
    (
        r"test_net\.TestNeuralNet::test_(save|load)_params_(no_state_dict|unknown_attribute)_raises$",
        ("off", "on"), "c",
        "asserts skorch's message text '... that is a PyTorch Module or Optimizer'; "
        "ampnet's persistence.py says '... that has a state_dict' (same check, same "
        "AttributeError).",
    ),
    (
        CUSTOM_DEVICE, ("on",), "b",
        "with AMP on the device must be a real torch device type (autocast needs "
        "it); ampnet raises ValueError instead of falling back to float32.",
    ),
    (
        r"test_classifier\.TestNeuralNet::test_(takes_log_with_nllloss"
        r"|takes_no_log_without_nllloss)$", ("on",), "b",
        "bf16 resolution: the module's Softmax runs in bfloat16 under CPU autocast, "
        "so the module's own output (returned as float32), which these tests read inside "
        "get_loss, carries ~3 significant digits and its rows sum to 1 only within ~4e-3; "
        "the tests need rtol 1e-5. predict_proba renormalizes such rows "
        "(output_checks.probabilities_summing_to_one), so test_predict_and_predict_proba passes.",
    ),
    (
        r"test_net\.TestNeuralNet::test_(forward|predict_nonlinearity_is_identity_with_multiple_criteria)$",
        ("on",), "b",
        "predict_proba sums to 1 (scikit-learn's convention): a classifier's rows from a bfloat16 softmax "
        "(within ~4e-3 of 1) are divided by their sum (output_checks.probabilities_summing_to_one), while "
        "forward returns the module's own bfloat16-rounded output; the tests compare the two with "
        "np.allclose (rtol 1e-5). docs/user_guide/precision.md, 'Probabilities sum to 1'.",
    ),
    (
        r"test_regressor\.TestNeuralNetRegressor::test_dimension_mismatch_warning$", ("off", "on"), "b",
        "a 1-D y against the regressor's (n, 1) output: MSELoss would broadcast them to (n, n) "
        "and compare every prediction with every target (torch only warns, the warning the "
        "test counts); ampnet refuses it at the first training batch with a ValueError naming "
        "both shapes and the fix y.reshape(-1, 1) (user_inputs.check_target_shape).",
    ),
    (
        r"test_net\.TestNeuralNet::test_net_init_two_unknown_arguments$", ("off", "on"), "b",
        "a misspelled argument gets the close valid name appended to skorch's message "
        "('... explicitly. Did you mean batch_size (for bathc_size), max_epochs (for mxa_epochs)?'); "
        "the test compares the whole message with skorch's (reconfigure.with_name_hints; "
        "docs/user_guide/skorch_differences.md).",
    ),
    # test_doctor.py (SKORCH_SUITE_FILES=test_doctor.py): SkorchDoctor on AMP nets
    (
        r"test_doctor\.TestSkorchDoctorSimple::test_activation_recs_values$", ("on",), "b",
        "bf16 resolution: the recorded activations are the layers' bfloat16 outputs (as "
        "float32 arrays); the test compares them with float32 values to 6 decimals.",
    ),
]


def classify(test_id: str, mode: str) -> tuple[str, str] | None:
    """(category, explanation) for an ampnet-only failure, or None."""
    for pattern, modes, category, note in KNOWN:
        if mode in modes and re.search(pattern, test_id):
            return category, note
    return None
