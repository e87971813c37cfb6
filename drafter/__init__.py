"""drafter-release library."""
__version__ = "0.1.0"
