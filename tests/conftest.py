import os
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# every template a test renders must find its fields (render/format.py fill); users get what can be filled
os.environ.setdefault("OOMDOCTOR_STRICT_TEMPLATES", "1")

sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(os.environ.get("OOMDOCTOR_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SNAPSHOTS = SHARED / "snapshots"


@pytest.fixture(scope="session")
def snapshots() -> Path:
    if not SNAPSHOTS.is_dir():
        pytest.skip(f"shared snapshots not found at {SNAPSHOTS} (set OOMDOCTOR_SHARED)")
    return SNAPSHOTS


def _fastest_first(items) -> None:
    """Under mutmut (``MUTANT_UNDER_TEST`` set, cwd ``mutants/``), order the tests by the durations mutmut recorded,
    fastest first: mutmut runs them with ``-x``, so a mutant killed by a fast unit test never waits for the corpus
    tests. The order changes no result; without the statistics the order is left as collected."""
    import json

    stats = Path("mutmut-stats.json")
    if "MUTANT_UNDER_TEST" not in os.environ or not stats.is_file():
        return
    try:
        duration = json.loads(stats.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: duration.get(item.nodeid.removeprefix("mutants/"), float("inf")))


def pytest_collection_modifyitems(config, items):
    _fastest_first(items)
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


@pytest.fixture(scope="session")
def demo_trace():
    """The real snapshot shipped in the package (``diagnose --demo``), loaded."""
    import oomdoctor
    from oomdoctor.cli.diagnose import demo_path

    return oomdoctor.load(demo_path())
