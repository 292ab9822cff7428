"""Session-wide test set-up.

Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported; set it (and disable Ray's
token auth) before any test module imports Ray, so every Ray node stays on 127.0.0.1.
"""

import os

from cluster.control.launch import ray_env_defaults  # imports no Ray

ray_env_defaults()

# NIXL's UCX: keep its control traffic (and TCP data, where CMA is not allowed) on loopback.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
