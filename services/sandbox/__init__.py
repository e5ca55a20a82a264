"""Sandbox Kubernetes API server for tests and the local demo (not a production service)."""
