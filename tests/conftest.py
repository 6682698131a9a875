import os

import pytest

# hybridengine is imported as installed (pip install -e .). tests/ itself is on sys.path through
# pytest's default "prepend" import mode (tests/ has no __init__.py), so the tests import its
# helpers by name: dist_utils, model_utils, tool_utils (which loads the scripts of tools/).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HYBRIDENGINE_NO_PROGRESS", "1")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only contend on a shared 2-core machine (50x slower)."""
    import torch
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
