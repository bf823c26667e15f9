"""The TLS context of a `Connection`: server verification (`verify=`) and a client certificate (`cert=`)."""

from __future__ import annotations

import os
import ssl

import httpx

__all__ = ["tls_context"]


def tls_context(verify: bool | str | ssl.SSLContext, cert: str | tuple[str, ...] | None) -> ssl.SSLContext:
    """One `ssl.SSLContext` for every connection.

    `verify`: True (httpx's trust store: certifi, or `SSL_CERT_FILE` / `SSL_CERT_DIR`), False
    (no verification: only for tests), a CA bundle file or folder, or a ready context (used
    as is). `cert`: a PEM file with certificate and key, or (certificate, key[, password]).
    Bad paths raise `ValueError` here, not at the first request.
    """
    if isinstance(verify, ssl.SSLContext):
        ctx = verify
    elif verify is True:
        ctx = httpx.create_ssl_context()
    elif verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, (str, os.PathLike)):
        path = os.fspath(verify)
        try:
            ctx = ssl.create_default_context(capath=path) if os.path.isdir(path) else \
                ssl.create_default_context(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"verify={path!r}: not a readable CA bundle ({exc})") from None
    else:
        raise ValueError(f"verify must be True, False, a CA bundle path or an ssl.SSLContext, not {type(verify).__name__}")
    if cert is not None:
        parts = (cert,) if isinstance(cert, (str, os.PathLike)) else tuple(cert)
        if not 1 <= len(parts) <= 3:
            raise ValueError("cert must be a PEM path or (certificate, key[, password])")
        try:
            ctx.load_cert_chain(*parts)  # type: ignore[arg-type]
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cert={parts[0]!r}: the client certificate could not be loaded ({exc})") from None
    return ctx
