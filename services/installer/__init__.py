"""Installer: the rollout driver that moves node agents to a target library version in batches."""
