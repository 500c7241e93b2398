"""The scheduling policies a deployment may run (engine/scheduling/scheduling_policy.py
implements them): which waiting request starts next. Here, in the torch-free request layer,
because a request's `priority` field and the router's limits name them too."""
from __future__ import annotations

SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_SCHEDULING_POLICY = "fcfs"
