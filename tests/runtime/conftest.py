"""The runtime tests' helper `running` lives in tests/helpers/runtime.py; this name stays until
every test module imports it from there."""

from tests.helpers.runtime import running

__all__ = ["running"]
