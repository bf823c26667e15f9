"""Where a `Connection` goes and how it gets there: replica URLs, proxies, TLS.

- `Origin`: one replica base URL, parsed once, with what every request to it carries. A base
  URL may hold userinfo (`http://user:pass@host`: sent as HTTP Basic auth) and a query string
  (`?api-version=1`: appended to every request). It names the service root, and an OpenAI-style
  base ending in `/v1` (`http://host:8000/v1`, what users paste) names the same root: requests
  go to their own paths (`/v1/models`, `/tokenize`) under it, never to `/v1/v1/...`; `api_url`
  keeps the URL as given for OpenAI clients. `url` is what messages show: the root, no
  userinfo, no query.
- The proxy for it comes from the environment (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`,
  `NO_PROXY`, as curl and httpx read them) unless `trust_env=False`; `check_proxy` refuses
  at construction one that httpx cannot use.
- `tls_context`: server verification (`verify=`) and a client certificate (`cert=`), one
  `ssl.SSLContext` for every connection.

Nothing here runs on a request's way out: it is all worked out when a `Connection` is made.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import ssl
import urllib.request
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

import httpx

__all__ = ["Origin", "check_proxy", "shown", "tls_context"]

Verify = bool | str | ssl.SSLContext
"""TLS verification: True (httpx's trust store), False (none), a CA bundle path, or a ready context."""
Cert = str | tuple[str, str] | tuple[str, str, str]
"""A client certificate: a PEM file with certificate and key, or (certificate, key[, password])."""


@dataclass(frozen=True, slots=True, eq=False)
class Origin:
    """A replica base URL: where to connect, what to put in the request line and head."""

    url: str
    """The service root without userinfo or query (a trailing `/v1` left out): safe to show in
    messages, logs and spans."""
    host: str
    port: int
    tls: bool
    host_header: str
    base_path: str
    """The root's path, percent-encoded, without a trailing slash (or `/v1`)."""
    query: str
    """`?` and the base URL's query string, or empty."""
    authorization: str | None
    """`Basic ...` from the URL's userinfo, or None."""
    proxy: str | None
    """The proxy URL the environment names for this origin, or None (connect directly)."""
    api_url: str
    """The URL as given, `/v1` kept, without userinfo or query: an OpenAI client's `base_url`."""

    @classmethod
    def parse(cls, url: str, *, trust_env: bool = True) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URLs must be http(s) URLs, got {shown(url)!r}")
        if parts.fragment:
            raise ValueError(f"a base URL cannot carry a #fragment: {shown(url)!r}")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"the base URL's port is not a number: {shown(url)!r}") from None
        tls = parts.scheme == "https"
        host_port = parts.netloc.rpartition("@")[2]
        authorization = None
        if parts.username is not None or parts.password is not None:
            pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            authorization = "Basic " + base64.b64encode(pair.encode()).decode()
        given = quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=~")
        path = given.removesuffix("/v1")
        return cls(url=f"{parts.scheme}://{host_port}{path}", host=parts.hostname,
                   port=port or (443 if tls else 80), tls=tls, host_header=host_port.encode("idna").decode(),
                   base_path=path, query=f"?{parts.query}" if parts.query else "", authorization=authorization,
                   proxy=environment_proxy(parts.scheme, parts.hostname, port) if trust_env else None,
                   api_url=f"{parts.scheme}://{host_port}{given}")


def environment_proxy(scheme: str, host: str, port: int | None) -> str | None:
    """The proxy URL the environment names for `scheme://host:port`, or None.

    `HTTPS_PROXY` / `HTTP_PROXY` by scheme, else `ALL_PROXY` (upper or lower case), unless
    `NO_PROXY` lists the host (a name, a domain suffix, `host:port`, or `*`).
    """
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(scheme) or proxies.get("all")
    if not proxy:
        return None
    target = f"{host}:{port}" if port else host
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]  # public, not in typeshed
    if bypass(target, proxies) or bypass(host, proxies):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def shown(url: str) -> str:
    """A URL as messages show it: userinfo and query left out."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def check_proxy(proxy: str) -> None:
    """Refuse at construction a proxy httpx cannot use (the message shows no credentials)."""
    try:
        url = httpx.URL(proxy)
    except httpx.InvalidURL:
        raise ValueError("the environment's proxy URL is not a URL; fix HTTP(S)_PROXY / ALL_PROXY") from None
    if url.scheme not in ("http", "https", "socks5", "socks5h"):
        raise ValueError(f"unsupported proxy scheme {url.scheme!r} in the environment (HTTP(S)_PROXY / ALL_PROXY); "
                         "use http, https or socks5, set NO_PROXY for this host, or pass trust_env=False")
    if url.scheme.startswith("socks") and importlib.util.find_spec("socksio") is None:
        raise ValueError("the environment names a SOCKS proxy: pip install 'httpx[socks]', "
                         "or set NO_PROXY for this host, or pass trust_env=False")


def tls_context(verify: Verify, cert: Cert | None) -> ssl.SSLContext:
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
        raise ValueError("verify must be True, False, a CA bundle path or an ssl.SSLContext, "
                         f"not {type(verify).__name__}")
    if cert is not None:
        parts: tuple[str, ...] = (cert,) if isinstance(cert, (str, os.PathLike)) else tuple(cert)
        if not 1 <= len(parts) <= 3:
            raise ValueError("cert must be a PEM path or (certificate, key[, password])")
        try:
            ctx.load_cert_chain(*parts)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cert={parts[0]!r}: the client certificate could not be loaded ({exc})") from None
    return ctx
