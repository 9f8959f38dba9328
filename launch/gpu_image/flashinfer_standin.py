"""A stand-in for flashinfer on the lent H200 (copied into the offline bundle as ``flashinfer``).

SGLang 0.5.17 imports flashinfer names at module load (the sampler, fp8 utilities, vision
attention...) even where it will never call them. The bundle carries this module instead of the
real package (its wheels and JIT builds do not fit the lease: manifest.json has the numbers), and
the server runs with ``SGLANG_IS_FLASHINFER_AVAILABLE=false --attention-backend triton
--speculative-draft-attention-backend triton --sampling-backend pytorch``. Any ``flashinfer.*``
submodule imports; any name in it is a class that raises when used, naming itself, so a code path
that really needs flashinfer fails loudly instead of computing something else.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+fastmtp.standin"
STAND_IN = True


class _Missing:
    _name = "flashinfer"

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is not available: this is fastmtp's flashinfer stand-in "
                           "(run SGLang with --attention-backend triton --sampling-backend pytorch)")

    def __init_subclass__(cls, **kwargs):
        pass


def _missing(qualname):
    return type(qualname.rsplit(".", 1)[-1], (_Missing,), {"_name": qualname})


def _module_getattr(modname):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _missing(f"{modname}.{attr}")
        setattr(sys.modules[modname], attr, value)
        return value
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
