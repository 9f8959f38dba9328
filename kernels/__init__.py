"""Triton kernels, each beside its pure-torch reference; installed as ``fastmtp_sglang.kernels``.

This folder sits at the repository's top level (docs/design.md section 10), where Python started
from the repository root (``python -c``, ``python -m pytest``, a notebook) finds it first under
the top-level name ``kernels``: the name of a PyPI package that transformers and sglang import.
Imported under that name, this file hands the import to the installed ``kernels`` (or raises
ModuleNotFoundError, as Python would, when none is installed), so the folder never shadows it.

Owns: ``compressed_head`` (the draft-vocabulary Triton kernels, their launcher and the torch
reference), ``compressed_slots`` (the slot layout both share).

May import: nothing of this package outside ``kernels``.
"""

if __name__ == "kernels":  # not us: the repository root is on sys.path
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # what `import kernels` returns once this file has run
    _spec.loader.exec_module(_module)
