"""Import-only stand-in for torchvision (test environment only): PyPI's torchvision builds do not
load beside the CPU torch here, and SGLang's config package imports torchvision.transforms for
vision models that the disaggregation path never runs. Anything used from it raises."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Unusable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Unusable":
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} was used, but torchvision is only a stand-in in this environment")

    def __mro_entries__(self, bases):
        return (object,)


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package: submodules import too
    module.__getattr__ = lambda attr: _Unusable(f"{name}.{attr}")  # type: ignore[method-assign]
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _module(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []
__version__ = "0.0.0+standin"


def __getattr__(attr: str) -> _Unusable:
    return _Unusable(f"torchvision.{attr}")
