"""Claims about how the merging rank waits for the others: woken by their journal lines and failure markers, not by
a clock."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.builds import cli_env, free_port

from image_edit_data.preprocess.run.journal import PROGRESS_DIR, Journal, write_failure
from image_edit_data.preprocess.run.merge import wait_for_journals
from image_edit_data.preprocess.run.rank_meeting import meet
from image_edit_data.preprocess.run.watch import DirectoryWatch

SKIPPED = {"row_index": 0, "location": "x", "kind": "empty prompt", "problem": "empty"}
HOUR = 3600.0


def waiting(root: Path, rows: int) -> tuple[threading.Thread, dict[str, Any]]:
    """`wait_for_journals` in a thread, looking on its own only once an hour; its result or error lands in the dict."""
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["entries"] = wait_for_journals(root, rows, since=0.0, timeout=HOUR, poll_interval=HOUR, log=print)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, outcome


def test_the_merging_rank_wakes_when_the_last_journal_line_lands(tmp_path: Path) -> None:
    assert DirectoryWatch(tmp_path).notifies  # Linux: the file system's own change events
    Journal(tmp_path, 1).append([{"position": 0, "skipped": SKIPPED}])
    thread, outcome = waiting(tmp_path, rows=2)
    time.sleep(0.3)  # the wait has looked once and found position 1 missing
    assert thread.is_alive()
    Journal(tmp_path, 0).append([{"position": 1, "skipped": SKIPPED}])
    thread.join(timeout=30)
    assert not thread.is_alive() and sorted(outcome["entries"]) == [0, 1]


def test_the_merging_rank_wakes_when_another_rank_reports_its_failure(tmp_path: Path) -> None:
    (tmp_path / PROGRESS_DIR).mkdir()
    thread, outcome = waiting(tmp_path, rows=2)
    time.sleep(0.3)
    write_failure(tmp_path, 1, "BadSampleError: edits.jsonl line 2: prompt: expected non-empty text, got ''")
    thread.join(timeout=30)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="rank 1 stopped, so the index was not merged .*line 2: prompt"):
        raise outcome["error"]


MEETING = """
import json, sys
from image_edit_data.preprocess.run.rank_meeting import meet
rank = int(sys.argv[1])
print(json.dumps(meet(rank, 2, "BadSampleError: line 3: no target" if rank == 1 else None, 60)))
"""


@pytest.mark.slow
def test_ranks_launched_together_tell_each_other_how_they_ended(tmp_path: Path) -> None:
    """Two real processes with torchrun's environment: the meeting is a gloo all-gather between processes."""
    env = cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", MEETING, str(rank)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=120) for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], outputs
    assert [json.loads(out) for out, _ in outputs] == [{"1": "BadSampleError: line 3: no target"}] * 2
    assert meet(0, 2, None, 1) is None  # without the launcher's environment there is no meeting
