"""Ray Serve deployments: one model deployment per base, and an HTTP ingress. No model maths here."""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # else Ray binds the external address
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
