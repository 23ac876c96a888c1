"""A user module that fails at import time."""

import this_package_does_not_exist  # noqa: F401
