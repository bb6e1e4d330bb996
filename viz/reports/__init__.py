"""Self-contained HTML reports (each only draws results computed elsewhere)."""
