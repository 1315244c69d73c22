"""Claim: importing any module of the package changes no global state of the importer.

A fresh interpreter imports the third-party libraries first (their own import-time effects are not
ours), notes the process-wide state a module could change (the garbage collector and its frozen
objects, signal handlers, hooks, environment, logging, warning filters, random states, threads,
torch's settings, the multiprocessing start method), imports every module of the package, and
notes it again. The one change allowed is the package's own finder for its moved module paths
(`_moved.py`), which resolves only old `image_edit_data.*` names.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.slow  # a fresh interpreter, so that nothing is imported yet

SNAPSHOT = r"""
import faulthandler, gc, hashlib, json, logging, multiprocessing, os, random, signal, socket, sys, threading, warnings
import numpy, torch

def snapshot():
    handlers = {}
    for number in sorted(signal.valid_signals()):
        try:
            handlers[int(number)] = repr(signal.getsignal(number))
        except (OSError, ValueError):
            continue
    root = logging.getLogger()
    return {
        "gc frozen": gc.get_freeze_count(),
        "gc enabled": gc.isenabled(),
        "gc threshold": list(gc.get_threshold()),
        "signal handlers": handlers,
        "hooks": [repr(sys.excepthook), repr(threading.excepthook), repr(sys.breakpointhook)],
        "meta path": [type(f).__qualname__ for f in sys.meta_path if type(f).__qualname__ != "MovedPathFinder"],
        "path": list(sys.path),
        "environment": dict(os.environ),
        "recursion limit": sys.getrecursionlimit(),
        "switch interval": sys.getswitchinterval(),
        "logging": [root.level, [repr(h) for h in root.handlers], logging.root.manager.disable],
        "warning filters": [repr(f) for f in warnings.filters],
        "random": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
        "numpy random": hashlib.sha256(numpy.random.get_state()[1].tobytes()).hexdigest(),
        "torch random": hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest(),
        "torch": [torch.get_num_threads(), str(torch.get_default_dtype()), torch.is_grad_enabled()],
        "start method": multiprocessing.get_start_method(allow_none=True),
        "threads": sorted(t.name for t in threading.enumerate()),
        "faulthandler": faulthandler.is_enabled(),
        "socket timeout": socket.getdefaulttimeout(),
    }

import fsspec, jsonargparse, lightning.pytorch, safetensors, s3fs, torchdata, xxhash  # third-party effects first
for optional in ("obstore", "diffusers", "transformers", "peft", "datasets", "PIL"):
    try:
        __import__(optional)
    except ImportError:
        pass
before = snapshot()
import pkgutil, importlib, image_edit_data
names = sorted(m.name for m in pkgutil.walk_packages(image_edit_data.__path__, "image_edit_data."))
for name in names:
    importlib.import_module(name)
after = snapshot()
changed = {key: [before[key], after[key]] for key in before if before[key] != after[key]}
print(json.dumps({"modules": len(names), "changed": changed}))
"""


def test_importing_every_module_changes_no_global_state_of_the_importer(tmp_path: Path) -> None:
    """A fresh interpreter: only one that has imported nothing of ours shows what an import changes."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", SNAPSHOT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["modules"] > 100  # every module, server_freeze.py among them
    assert report["changed"] == {}
