"""Integrations with other libraries (imported on demand)."""
