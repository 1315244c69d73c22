"""Run a multi-process command so that a timeout kills all of it, not only its first process.

Lightning's DDP launcher starts rank 1 and up, and every rank its loader workers; killing rank 0
alone on a timeout would leave them running into the tests after.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_process_group(
    command: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True)` in its own session; on timeout SIGKILL the session."""
    process = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(process.args, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
