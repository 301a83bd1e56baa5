"""Round 22: the outsiders' batch 18 (dev data since batch 19 became the blind set): a library that refuses the
installed torch, and operator libraries built for another torch.

Each paste is made up in the shape of the library's message (transformers' `utils/import_utils.py`, torch's
`_ops.py` namespace lookup, an extension loader's missing `.so`), not taken from a thread.
"""

from __future__ import annotations

from tests.helpers import likely_categories as _cats


def test_transformers_switching_torch_off_is_a_version_pairing() -> None:
    paste = ("Disabling PyTorch because PyTorch >= 2.1 is required but found 2.0.1+cu117\n"
             "None of PyTorch, TensorFlow >= 2.0, or Flax have been found. Models won't be available and only "
             "tokenizers, configuration and file/data utilities can be used.\n")
    assert _cats(paste)[0] == "library_version_regression"
    # the second line alone is weaker evidence (a torch that is simply missing says the same) but still ranks it
    assert "library_version_regression" in _cats(paste.splitlines()[1])[:3]


def test_an_operator_library_built_for_another_torch_names_both_causes() -> None:
    paste = ('  File "/usr/lib/python3.10/site-packages/torch/_ops.py", line 498, in __getattr__\n'
             "    ) from e\n"
             "AttributeError: '_OpNamespace' 'mylib' object has no attribute 'fused_gather'\n")
    top = _cats(paste)[:3]
    assert {"extension_abi_mismatch", "library_version_regression"} <= set(top)
    missing = ">>> import mylib\nFile mylib_py.so not found\n"
    assert {"extension_abi_mismatch", "library_version_regression"} <= set(_cats(missing)[:3])


def test_a_users_own_missing_attribute_is_not_an_operator_library() -> None:
    # an ordinary AttributeError on a user's object names no torch.ops namespace
    paste = "AttributeError: 'Namespace' object has no attribute 'fused_gather'\n"
    assert "extension_abi_mismatch" not in _cats(paste)[:3]
