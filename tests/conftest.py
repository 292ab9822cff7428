"""Session-wide test set-up.

Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported; set it (and disable Ray's
token auth) before any test module imports Ray, so every Ray node stays on 127.0.0.1.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
