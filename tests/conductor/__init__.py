"""Conductor tests."""
