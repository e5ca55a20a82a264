"""`kubectl isolator`: what an operator sees of isolation, read from the Kubernetes API alone."""
