"""Small helpers with no home of their own in the engine."""
