"""Throwaway TLS material for the secured test broker, made with the ``openssl`` CLI (stdlib only).

``generate(directory)`` writes a CA, the broker's certificate (CN=broker, SAN IP:127.0.0.1 and
DNS:localhost), and a second "foreign" CA that signs nothing the broker trusts. ``TlsMaterial.client_cert``
issues a client certificate for a CN, optionally already expired. Keys are EC P-256, unencrypted PKCS#8
PEM, mode 0600. Certificates are issued with ``openssl ca`` so the validity window can be set exactly
(OpenSSL 3.0's ``x509 -req`` has no ``-not_before/-not_after``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

BROKER_CN = "broker"
VALID_DAYS = 30
# notBefore/notAfter of an expired certificate: a day long, years ago
EXPIRED_START = "20200101000000Z"
EXPIRED_END = "20200102000000Z"
_CN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

_CA_CONFIG = """\
[ ca ]
default_ca = harness_ca

[ harness_ca ]
database = {work}/index.txt
serial = {work}/serial
new_certs_dir = {work}
default_md = sha256
policy = policy_any
unique_subject = no
copy_extensions = none
email_in_dn = no

[ policy_any ]
commonName = supplied

[ leaf ]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyAgreement
extendedKeyUsage = serverAuth, clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
{san}
"""


class TlsError(RuntimeError):
    """``openssl`` failed or is missing."""


def _openssl(*args: str, cwd: Path | None = None) -> None:
    try:
        result = subprocess.run(
            ["openssl", *args], capture_output=True, text=True, timeout=60, check=False, cwd=cwd
        )
    except FileNotFoundError as exc:
        raise TlsError("openssl not found on PATH") from exc
    if result.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")


def _new_key(path: Path) -> Path:
    """An unencrypted PKCS#8 EC P-256 key, readable by the owner only."""
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)
    return path


def _check_cn(cn: str) -> str:
    if not _CN.match(cn):
        raise ValueError(f"certificate CN must match {_CN.pattern}: {cn!r}")
    return cn


@dataclass(frozen=True)
class CertificateAuthority:
    """A self-signed CA (cert + key PEM) that can issue leaf certificates."""

    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path, name: str) -> CertificateAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        key = _new_key(directory / f"{name}.key")
        cert = directory / f"{name}.pem"
        _openssl(
            "req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", str(VALID_DAYS),
            "-subj", f"/CN=sandbox-lanes test {name}", "-sha256",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-addext", "subjectKeyIdentifier=hash",
        )  # fmt: skip
        return cls(cert=cert, key=key)

    def issue(
        self,
        cn: str,
        directory: Path,
        *,
        stem: str | None = None,
        sans: tuple[str, ...] = (),
        expired: bool = False,
    ) -> tuple[Path, Path]:
        """Write ``<stem>.pem`` and ``<stem>.key`` for ``CN=<cn>`` into directory; return (cert, key)."""
        _check_cn(cn)
        stem = stem or cn
        directory.mkdir(parents=True, exist_ok=True)
        key = _new_key(directory / f"{stem}.key")
        cert = directory / f"{stem}.pem"
        work = Path(tempfile.mkdtemp(prefix="ca-", dir=directory))
        try:
            (work / "index.txt").write_text("")
            (work / "serial").write_text(f"10{os.urandom(15).hex()}\n")  # even length, positive
            san = f"subjectAltName = {', '.join(sans)}" if sans else ""
            config = work / "ca.cnf"
            config.write_text(_CA_CONFIG.format(work=work, san=san))
            csr = work / "req.csr"
            _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
            validity = (
                ["-startdate", EXPIRED_START, "-enddate", EXPIRED_END]
                if expired
                else ["-days", str(VALID_DAYS)]
            )
            _openssl(
                "ca", "-batch", "-notext", "-config", str(config), "-extensions", "leaf",
                "-cert", str(self.cert), "-keyfile", str(self.key), "-in", str(csr), "-out", str(cert),
                *validity,
            )  # fmt: skip
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return cert, key


@dataclass(frozen=True)
class TlsMaterial:
    """Everything ``generate`` wrote: the trusted CA, the broker's identity and the foreign CA."""

    directory: Path
    ca: CertificateAuthority
    foreign_ca: CertificateAuthority
    broker_cert: Path
    broker_key: Path
    broker_keystore: Path  # key + certificate in one PEM file: Kafka's ssl.keystore.type=PEM location

    @property
    def ca_file(self) -> Path:
        return self.ca.cert

    @property
    def foreign_ca_file(self) -> Path:
        return self.foreign_ca.cert

    def client_cert(self, cn: str, *, expired: bool = False) -> tuple[Path, Path]:
        """A client certificate + key for ``CN=<cn>`` signed by the trusted CA; (cert, key)."""
        stem = f"{cn}-expired" if expired else cn
        return self.ca.issue(cn, self.directory / "clients", stem=stem, expired=expired)


def generate(directory: Path) -> TlsMaterial:
    """Create the CA, the broker certificate and the foreign CA under directory."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    ca = CertificateAuthority.create(directory, "ca")
    foreign = CertificateAuthority.create(directory, "foreign-ca")
    cert, key = ca.issue(BROKER_CN, directory, sans=("IP:127.0.0.1", "DNS:localhost"))
    keystore = directory / "broker-keystore.pem"
    fd = os.open(keystore, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key.read_text() + cert.read_text())
    return TlsMaterial(directory, ca, foreign, cert, key, keystore)
