"""Test configuration: a hypothesis profile sized for a 2-core CPU.

Every new leaf shape or static argument costs a jit compilation (about 1-3 s
for the radix-select kernels on CPU), so property tests draw from a small set
of tree templates and keep the example count modest.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
