"""What the epoch plan needs is loaded with the package, not by a loader's first batch."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT


def test_importing_the_loader_config_loads_numpy_random_which_numpy_would_load_at_the_first_plan() -> None:
    code = "import sys, image_edit_data.dataloader_config; print('numpy.random' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert result.stdout.strip() == "True"
