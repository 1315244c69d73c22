"""Imported last by the workers' fork server: what it loaded is collected once and frozen.

Importing torch leaves the server with a full garbage collection owed (over some 170 thousand
objects, tens of milliseconds here). Frozen, those objects are out of the collector's reach in the
server and in every worker it forks: no worker pays that collection in its first batch, and none
writes to the inherited pages that hold them (which would copy them into the worker). Workers
freeze again when they start (`watch.start_worker`), for what they received themselves.
"""

from __future__ import annotations

import gc

gc.collect()
gc.freeze()
