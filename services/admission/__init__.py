"""Mutating admission webhook: AdmissionReview in, JSON patch that injects libvgpu.so out."""
