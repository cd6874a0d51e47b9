"""Placeholder registration module for the `zoo` commands."""
