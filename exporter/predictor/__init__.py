"""exporter/predictor: (map written later)."""
