"""exporter/planner: (map written later)."""
