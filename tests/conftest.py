"""Session-wide test set-up.

Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported; set it (and disable Ray's
token auth) before any test module imports Ray, so every Ray node stays on 127.0.0.1.
"""

from cluster.control.launch import ray_env_defaults  # imports no Ray

ray_env_defaults()
