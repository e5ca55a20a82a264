"""`kai-isolator certs`: a one-shot that gives the webhook a serving certificate and the API server its CA."""
