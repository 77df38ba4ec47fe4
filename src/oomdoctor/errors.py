"""The whole error vocabulary of oomdoctor.

Every error a user can cause derives from :class:`OomdoctorError`; the CLI turns it into one line on
stderr and a non-zero exit code (``exit_code``). Nothing else is caught there, so a bug still shows
its traceback.
"""

from __future__ import annotations

EXTRAS = {"preflight": "torch transformers", "dask": "distributed"}
"""The packages of each optional extra of ``pyproject.toml`` (``[project.optional-dependencies]``), by name."""


def install_hint(extra: str) -> str:
    """How to get what an optional extra holds: its packages by name, which works however oomdoctor was installed,
    and the extra itself from a checkout of oomdoctor (the package is installed from its repository, not from an
    index, so the extra named after the package finds nothing). Raises KeyError for an unknown extra."""
    return f"pip install {EXTRAS[extra]} (from a checkout of oomdoctor: pip install '.[{extra}]')"


class OomdoctorError(Exception):
    """Base class of every error oomdoctor raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code: int = 1


class SnapshotError(OomdoctorError):
    """A file that cannot be read as a CUDA memory snapshot: missing, empty, truncated, corrupt, or
    not a snapshot. The message names the file and the problem."""

    exit_code = 2

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsafeSnapshotError(SnapshotError):
    """A pickle that asks to import a global (a class or function): refused, never executed."""

    def __init__(self, path: object, global_name: str) -> None:
        self.global_name = global_name
        super().__init__(
            path,
            f"refused to unpickle global '{global_name}': a memory snapshot holds only plain data "
            "(dict, list, tuple, str, bytes, int, float, bool, None), so this file is not one or was tampered with",
        )


class UsageError(OomdoctorError):
    """Bad command-line use that click cannot catch by itself (e.g. no input given)."""

    exit_code = 2
