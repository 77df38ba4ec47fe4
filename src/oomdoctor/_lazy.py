"""Names of a package loaded from their modules on first use (PEP 562), so that importing a package, or one
of its submodules, does not import all of them: ``oomdoctor --help`` and each command load only what they use.

A name that is also a submodule (``analysis.lifetimes``) must be imported eagerly instead: once the
submodule is imported anywhere, Python sets it as the package's attribute and it would shadow the name.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` (a submodule, relative to
    the package) on first access of ``name`` and caches the value in the package.

    Raises (from the returned function):
        AttributeError: ``name`` is not one of ``names``.
    """
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f".{names[name]}", package)
        value = getattr(module, name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
