"""The package's layering (README "Layout of the code"): a module imports only from its own
layer or the layers below it, so each layer can be read, tested and replaced without the ones
above. Read from the source (ast), imports inside functions included."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hybridengine"
# lower number = lower layer; a module may import from layers with a number <= its own
LAYER = {"parallel": 0, "compiling": 0, "device_memory": 0, "kernels": 1, "models": 2, "train": 3,
         "rollout": 3, "hybrid": 4, "rl": 5, "config": 5}


def _imported_packages(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "hybridengine" and len(parts) > 1:
                yield parts[1], node.lineno


def test_every_module_imports_only_its_layer_and_below():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        own = rel.parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        assert own in LAYER, f"{rel}: a package the layering does not know: add it to LAYER"
        for other, line in _imported_packages(path):
            if other == own:
                continue
            assert other in LAYER, f"{rel}:{line} imports hybridengine.{other}, not in LAYER"
            if LAYER[other] > LAYER[own]:
                wrong.append(f"{rel}:{line} ({own}, layer {LAYER[own]}) imports {other} "
                             f"(layer {LAYER[other]})")
    assert not wrong, "upward imports:\n" + "\n".join(wrong)
