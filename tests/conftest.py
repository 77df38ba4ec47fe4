import os
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(os.environ.get("OOMDOCTOR_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SNAPSHOTS = SHARED / "snapshots"


@pytest.fixture(scope="session")
def snapshots() -> Path:
    if not SNAPSHOTS.is_dir():
        pytest.skip(f"shared snapshots not found at {SNAPSHOTS} (set OOMDOCTOR_SHARED)")
    return SNAPSHOTS


def pytest_collection_modifyitems(config, items):
    try:
        import torch  # noqa: F401

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="no CUDA GPU here")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
