"""The distributed world: the backends and the settings that bound a failure (``distributed``,
``backend_choice``), liveness pings, Spot preemption, the launchers' exit status (``launcher_exit``)
and the lifetime of a rank's helper processes.

Runs on the nodes. Framework-neutral at import time.
"""
