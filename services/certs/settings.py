"""Settings of `kai-isolator certs` (env `KAI_ISOLATOR_*`, flags override)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from kai_isolator.shared.settings import _Settings

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class CertsSettings(_Settings):
    """Which Secret, Service and MutatingWebhookConfiguration the one-shot works on, and for how long a pair lives."""

    namespace: str | None = Field(None, description="namespace of the webhook Service and Secret (default: this pod's)")
    service_name: str = Field("kai-resource-isolator-webhook", description="webhook Service; its DNS names go in the certificate")
    secret_name: str = Field("kai-resource-isolator-webhook-tls", description="kubernetes.io/tls Secret the webhook mounts")
    webhook_config: str = Field("kai-resource-isolator-mutating", description="MutatingWebhookConfiguration whose caBundle is set; empty = none")
    webhook_config_manifest: Path | None = Field(None, description="create the configuration from this YAML/JSON file when it is missing")
    hosts: list[str] = Field(default_factory=list, description="extra DNS names or IPs the certificate covers")
    validity_days: int = Field(3650, ge=1, le=36500)
    renew_before_days: int = Field(30, ge=0)
    out_dir: Path | None = Field(None, description="write ca.crt, tls.crt, tls.key here instead of a Secret (compose, the local control plane)")
    kubeconfig: Path | None = Field(None, description="kubeconfig file; unset = in-cluster service account")

    @model_validator(mode="after")
    def _renewal_fits(self) -> CertsSettings:
        if self.renew_before_days >= self.validity_days:
            raise ValueError(f"renew_before_days ({self.renew_before_days}) must be below validity_days ({self.validity_days}), "
                             "or every run would issue a new pair")
        return self

    def resolved_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        try:
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        except OSError:
            return ""

    def all_hosts(self, namespace: str) -> list[str]:
        """The names the API server may dial: the Service in every spelling, then the extras."""
        names = []
        if namespace and self.service_name:
            svc, ns = self.service_name, namespace
            names = [f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local", f"{svc}.{ns}", svc]
        for host in self.hosts:
            if host not in names:
                names.append(host)
        return names
