"""Helpers that more than one test module needs (never a test module imported by another)."""
