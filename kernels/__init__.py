"""Triton kernels, each beside its pure-torch reference; installed as ``fastmtp_sglang.kernels``.

This folder sits at the repository's top level (docs/design.md section 10), where Python started
from the repository root (``python -c``, ``python -m pytest``, a notebook) finds it first under
the top-level name ``kernels``: the name of a PyPI package that transformers and sglang import.
Imported under that name, this file hands the import to the installed ``kernels``, so the folder
never shadows it. When none is installed it stays an empty module without ``__file__``, as a
namespace package would be: transformers' availability check (``find_spec``, then an import when
there is no metadata) then reads "not installed" instead of failing on an ImportError.

Owns: ``compressed_head`` (the draft-vocabulary Triton kernels, their launcher and the torch
reference), ``compressed_slots`` (the slot layout both share).

May import: nothing of this package outside ``kernels``.
"""

if __name__ == "kernels":  # not us: the repository root is on sys.path
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])
    if _spec is None or _spec.loader is None:
        __file__ = None  # (what transformers reads as "a namespace package, not an install")
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # what `import kernels` returns once this file has run
        _spec.loader.exec_module(_module)
