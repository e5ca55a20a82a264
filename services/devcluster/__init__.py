"""The local control plane: real etcd + kube-apiserver built from Go, with KAI-Scheduler and GPU nodes simulated through its API.

A DEV AND TEST FIXTURE (`make run`, `kai-isolator dev`, docker-compose, the tests), never a production cluster.
"""
