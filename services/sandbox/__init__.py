"""Sandbox Kubernetes API server: a TEST AND DEMO FIXTURE, never a production component.

It speaks a faithful subset of kube-apiserver's REST and watch protocol (resourceVersions,
bookmarks, 410 Gone, selectors, mutating admission over HTTPS) so the services' real
kubernetes-asyncio code, and real kubectl, run unchanged on machines without a cluster.
"""
