"""The cluster tier (L2): the tier the engine asks after its local store, its two
backends, the leases that keep nodes from decoding one array at once, the
circuit breaker, and the Dask warm that fills L2 from many nodes.

Imports only the shared vocabulary (decodefs.common). Other folders import what
this file exports, never its rooms.
"""

from .backends import open_backend
from .dask_warm import SchedulerUnreachable, cluster_warm
from .tier import L2Miss, L2Tier

__all__ = ["L2Miss", "L2Tier", "SchedulerUnreachable", "cluster_warm", "open_backend"]
