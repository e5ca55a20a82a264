"""Common package: schemas, subjects, settings, bus runtime, logging."""
