"""Lint rules on data loading (GO1xx)."""
