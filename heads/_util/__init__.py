"""Internal helpers: safe file writing, progress reporting, shared validators."""
