"""Test helpers: tiny models and releases in the formats the pipeline reads (not part of the library)."""
