"""A private certificate authority that keeps its key: serving and client certificates for local control planes.

EC P-256 throughout; certificates are backdated a little so a clock that lags still accepts them.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_KEY_USAGES = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
               "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, cert_path: Path, key_path: Path) -> tuple[Path, Path]:
        cert_path.write_bytes(self.cert_pem)
        key_path.touch(mode=0o600)
        key_path.write_bytes(self.key_pem)
        return cert_path, key_path


def general_name(host: str) -> x509.GeneralName:
    """An IP literal as an IP SAN, anything else as a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def key_usage(**enabled: bool) -> x509.KeyUsage:
    return x509.KeyUsage(**{name: enabled.get(name, False) for name in _KEY_USAGES})


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def public_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


class CertificateAuthority:
    """A CA held in memory for as long as it issues: one per local control plane or dev stack."""

    def __init__(self, common_name: str, *, validity_days: int = 30) -> None:
        now = datetime.datetime.now(datetime.timezone.utc)
        self._not_before, self._not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=validity_days)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self._cert = (
            self._builder(self._name, self._key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(key_usage(key_cert_sign=True, crl_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = self._cert.public_bytes(serialization.Encoding.PEM)

    def _builder(self, subject: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(self._name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(self._not_before).not_valid_after(self._not_after))

    def _leaf(self, subject: x509.Name, usage: ExtendedKeyUsageOID, hosts: list[str] | None = None) -> KeyPair:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            self._builder(subject, key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(key_usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
        )
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName([general_name(h) for h in hosts]), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), private_key_pem(key))

    def issue_server(self, hosts: list[str]) -> KeyPair:
        """A serving certificate for `hosts` (DNS names or IP literals); the first names the subject."""
        if not hosts:
            raise ValueError("a serving certificate needs at least one host name")
        return self._leaf(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]), ExtendedKeyUsageOID.SERVER_AUTH, hosts)

    def issue_client(self, common_name: str, organization: str | None = None) -> KeyPair:
        """A client certificate: Kubernetes reads the user from the CN and the groups from O."""
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if organization:
            attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
        return self._leaf(x509.Name(attributes), ExtendedKeyUsageOID.CLIENT_AUTH)
