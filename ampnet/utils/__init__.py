"""Helpers every layer uses: warnings that point at the user's line, the low-precision dtypes, nested-structure walks, value checks and their messages, the process's random streams."""
