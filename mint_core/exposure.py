"""What a MinT service may expose where: a service listening beyond loopback must guard its
doors (keys, accounts, an auth string), and may speak TLS with the certificate it is given."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    """A service's certificate and key (PEM files, MINT_TLS_CERT and MINT_TLS_KEY); neither
    set: plain HTTP."""

    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError(
                f"names a certificate {self.cert!r} and a key {self.key!r}; set both "
                "MINT_TLS_CERT and MINT_TLS_KEY (PEM files) for TLS, or neither"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.cert)
