"""Watcher: lists and watches GPU-sharing pods and publishes their isolation story on the bus."""
