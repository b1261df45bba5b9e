"""Checkpoint conversion tools."""
