"""Reading untrusted bytes: every file of a checkpoint folder is opened,
read and checked here before a load hands on anything it holds.

- :mod:`~ampnet.io.untrusted.opening`: regular files only, links that stay
  in their folder, a size limit per kind of file (:data:`KINDS`); JSON;
- :mod:`~ampnet.io.untrusted.torch_files`: torch's zip and legacy formats,
  checked so that ``torch.load`` never allocates more than the file's size;
- :mod:`~ampnet.io.untrusted.pickles`: a pickle read as a skeleton (no code
  runs, nothing is allocated) and the calls it would make;
- :mod:`~ampnet.io.untrusted.values`: what a file held, its shape (no list
  inside itself, at most one entry per byte) and its numbers (within float
  range, tensors with values).

docs/user_guide/trust_model.md tells the whole of it.
"""

from ampnet.io.untrusted.opening import (
    JOURNAL_MAX_BYTES,
    KINDS,
    LOCK_MAX_BYTES,
    OPTIONAL_FILES,
    TENSOR_FILE_MAX_BYTES,
    is_path,
    max_bytes,
    open_untrusted,
    read_error,
    read_json,
    read_untrusted,
)
from ampnet.io.untrusted.torch_files import check_torch_file
from ampnet.io.untrusted.values import brief, check_values

__all__ = [
    "open_untrusted", "read_untrusted", "read_json", "is_path", "read_error", "KINDS", "OPTIONAL_FILES",
    "max_bytes", "TENSOR_FILE_MAX_BYTES", "JOURNAL_MAX_BYTES", "LOCK_MAX_BYTES", "check_torch_file",
    "brief", "check_values",
]
