"""Moved to ``normkit.testing`` (the one tolerance table); kept as an alias while imports move."""
from normkit.testing import TOLERANCES, assert_close  # noqa: F401
