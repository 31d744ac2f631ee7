import os

from hypothesis import settings

# CI runs a fixed set of examples (reproducible, never flaky); local runs explore new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
