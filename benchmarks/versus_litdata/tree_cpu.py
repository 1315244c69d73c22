"""CPU seconds of a whole process tree: this process, its live descendants, and every child any of them reaped.

A loader's workers may be this process's children (litdata forks them), grandchildren (ours start
from a fork server) or already gone (a non-persistent pool ends with its epoch). Linux adds a
child's CPU time to its parent's `cutime`/`cstime` when the parent reaps it, so summing, over this
process and each live descendant, its own and its reaped children's CPU counts every process of
the tree exactly once. Linux only (reads `/proc`); elsewhere only this process and its reaped children.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from image_edit_data.bench.measure import read_proc


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of `/proc/PID/stat` after the command name (which may hold spaces), or None if gone."""
    text = read_proc(f"/proc/{pid}/stat")
    return None if text is None else text.rsplit(")", 1)[1].split()


def descendants(root: int) -> list[int]:
    """PIDs of the live processes below `root`, found through each process's parent PID."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    stack = [root]
    while stack:
        children = parents.get(stack.pop(), [])
        found += children
        stack += children
    return found


def _with_reaped_children(pid: int) -> float:
    """CPU seconds of process `pid` and the children it has reaped (0 if it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # utime, stime, cutime, cstime: fields 14-17 of proc(5), 11-14 after the command name.
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process, its live descendants, and every process any of them reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    return total + sum(_with_reaped_children(pid) for pid in descendants(os.getpid()))
