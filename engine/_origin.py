"""`Origin`: one replica base URL, parsed once, with what every request to it carries.

A base URL may hold userinfo (`http://user:pass@host`: sent as HTTP Basic auth) and a query
string (`?api-version=1`: appended to every request). The proxy for it comes from the
environment (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`, `NO_PROXY`, as curl and httpx read
them) unless `trust_env=False`. `url` is what messages show: no userinfo, no query.
"""

from __future__ import annotations

import base64
import urllib.request
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

__all__ = ["Origin", "shown"]


@dataclass(frozen=True, slots=True, eq=False)
class Origin:
    """A replica base URL: where to connect, what to put in the request line and head."""

    url: str
    """The URL without userinfo or query: safe to show in messages, logs and spans."""
    host: str
    port: int
    tls: bool
    host_header: str
    base_path: str
    """The URL's path, percent-encoded, without a trailing slash."""
    query: str
    """`?` and the base URL's query string, or empty."""
    authorization: str | None
    """`Basic ...` from the URL's userinfo, or None."""
    proxy: str | None
    """The proxy URL the environment names for this origin, or None (connect directly)."""

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
        path = quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=~")
        return cls(url=f"{parts.scheme}://{host_port}{path}", host=parts.hostname,
                   port=port or (443 if tls else 80), tls=tls, host_header=host_port.encode("idna").decode(),
                   base_path=path, query=f"?{parts.query}" if parts.query else "", authorization=authorization,
                   proxy=environment_proxy(parts.scheme, parts.hostname, port) if trust_env else None)


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
    if urllib.request.proxy_bypass_environment(target, proxies) or urllib.request.proxy_bypass_environment(
            host, proxies):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def shown(url: str) -> str:
    """A URL as messages show it: userinfo and query left out."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
