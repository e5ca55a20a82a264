"""A private CA and the webhook's serving certificate: issue a new pair, or judge whether a stored one still serves."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_COMMON_NAME = "kai-resource-isolator webhook CA"


@dataclass(frozen=True)
class Bundle:
    """PEM bytes as a `kubernetes.io/tls` Secret stores them (plus the CA the API server must trust)."""

    ca_crt: bytes
    tls_crt: bytes
    tls_key: bytes


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not signs_certificates, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=signs_certificates,
        crl_sign=signs_certificates, encipher_only=False, decipher_only=False,
    )


def issue(hosts: list[str], validity_days: int, *, now: datetime.datetime | None = None) -> Bundle:
    """A new EC P-256 CA (kept only as its certificate: the CA key is thrown away) and a leaf for `hosts`."""
    if not hosts:
        raise ValueError("a serving certificate needs at least one host name")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    # Backdated a little: nodes whose clocks lag the Job's must still accept the certificate.
    not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=validity_days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Bundle(
        ca_crt=ca.public_bytes(serialization.Encoding.PEM),
        tls_crt=leaf.public_bytes(serialization.Encoding.PEM),
        tls_key=leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()),
    )


def still_serves(bundle: Bundle, hosts: list[str], renew_before_days: int, *, now: datetime.datetime | None = None) -> str | None:
    """None if the stored pair can keep serving `hosts`; else why it must be replaced."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_crt)
        leaf = x509.load_pem_x509_certificate(bundle.tls_crt)
        key = serialization.load_pem_private_key(bundle.tls_key, password=None)
    except ValueError as error:
        return f"stored pair does not parse: {error}"
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            leaf.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        return "stored key does not belong to the stored certificate"
    try:
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "stored certificate was not issued by the stored CA"
    expires = min(leaf.not_valid_after_utc, ca.not_valid_after_utc)
    if expires - now < datetime.timedelta(days=renew_before_days):
        return f"stored certificate expires {expires.isoformat()}, within {renew_before_days} days"
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "stored certificate has no subject alternative names"
    covered = {str(n.value) for n in names}
    missing = [h for h in hosts if str(_general_name(h).value) not in covered]
    if missing:
        return f"stored certificate does not cover {', '.join(missing)}"
    return None
