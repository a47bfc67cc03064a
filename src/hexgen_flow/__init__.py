"""HexGen-Flow: deadline-aware scheduling of agentic LLM workflows on heterogeneous GPUs."""

import glob as _glob
import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"
__all__ = ["__version__", "compiled_modules"]


def _register_compiled_runtime() -> None:
    """Where scripts/compile_core.py compiled the hot modules (optional), they load one
    shared library as a top-level module; it lies in this package (a top-level file under
    ``src/`` is not importable through an editable install), so it is registered under its
    own name before any compiled module asks for it. Without a build: nothing to do."""
    here = _os.path.dirname(__file__)
    for path in _glob.glob(_os.path.join(here, "*__mypyc.*.so")):
        name = _os.path.basename(path).split(".", 1)[0]
        if name in _sys.modules:
            continue
        spec = _util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            continue
        module = _util.module_from_spec(spec)
        _sys.modules[name] = module
        spec.loader.exec_module(module)


_register_compiled_runtime()


def compiled_modules() -> list[str]:
    """The modules of this package loaded so far that run compiled (scripts/compile_core.py:
    the compiled wheel, or `make compile` in a checkout), sorted; empty when all run as
    Python."""
    return sorted(
        name
        for name, module in list(_sys.modules.items())
        if name.startswith("hexgen_flow")
        and not (getattr(module, "__file__", None) or ".py").endswith(".py")
    )
