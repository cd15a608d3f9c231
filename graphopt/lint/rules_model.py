"""Lint rules on model structure (GO4xx)."""
