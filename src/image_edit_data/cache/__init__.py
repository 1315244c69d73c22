"""Building, validating and inspecting image-edit caches."""
