"""Shared pytest configuration. Server and Ray fixtures are session-scoped: one of each per run."""
