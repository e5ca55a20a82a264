"""Verifier: proves isolation is really active in each running GPU-sharing container."""
