"""A package only so that the test modules can import the shared helpers of conftest.py
with `from .conftest import ...` (the module pytest loads, not a second copy)."""
