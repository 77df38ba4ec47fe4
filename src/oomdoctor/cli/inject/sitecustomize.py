"""Injected by ``oomdoctor run`` into every Python process of the command, through ``PYTHONPATH``.

It does nothing unless ``OOMDOCTOR_RUN_CONFIG`` is set. It never imports torch itself: it waits for
the program to import torch, then queues the start of recording for CUDA's lazy initialisation, so
only processes that use CUDA record (not the launcher, not data-loader workers). Any other
``sitecustomize`` on the path still runs. Everything here is guarded: a failure warns and the
program runs on unchanged.
"""

import os
import sys


def _chain_original() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


def _install() -> None:
    try:
        import oomdoctor
    except ImportError:
        root = os.environ.get("OOMDOCTOR_PACKAGE_ROOT")
        if not root:
            raise
        sys.path.append(root)  # after the program's own paths: its packages keep precedence
        import oomdoctor
    import oomdoctor.capture.autorecord as autorecord

    # oomdoctor.record builds the recorder: it wires the in-job summary (above the capture package)
    autorecord.install_import_hook(make_recorder=oomdoctor.record)


try:
    _chain_original()
except Exception as _e:  # noqa: BLE001
    print(f"oomdoctor: the original sitecustomize failed: {_e}", file=sys.stderr)

if os.environ.get("OOMDOCTOR_RUN_CONFIG"):
    try:
        _install()
    except Exception as _e:  # noqa: BLE001
        print(f"oomdoctor: recording not set up in pid {os.getpid()}: {_e}", file=sys.stderr)
