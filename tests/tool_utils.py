"""Import a script from tools/ by its file path.

tools/ holds scripts run from the repository root (``python tools/bench_ppo.py``); it is not
part of the installed ``hybridengine`` package, so a test cannot import them by name. Loading one
from its file leaves sys.path alone: putting tools/ on it would let its data/, models/ and
rewards/ folders shadow any same-named module for every later test. A script that imports a
sibling by name (bench_ppo imports profiling) puts tools/ on sys.path itself, as when it is run.
"""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, loaded once and registered in sys.modules as ``tools_<name>`` (a
    dataclass or pickle resolves its module there)."""
    key = "tools_" + name.replace("/", "_")
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
