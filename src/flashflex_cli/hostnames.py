"""Host addresses as launch scripts name them: an RFC 1123 host name, an IPv4 address or an IPv6 address.

Anything else (`a;rm -rf x`, a space, a shell quote) cannot name a host; it is refused by name instead of
being rendered, even quoted, into a script that would fail on the remote side.
"""

from __future__ import annotations

import ipaddress
import re

# RFC 1123 section 2.1: labels of letters, digits and hyphens, 1-63 characters, neither starting nor ending with
# a hyphen; the whole name at most 253 characters (255 octets on the wire, less the length bytes).
_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
# The same with underscores, which `socket.gethostname()` returns on some machines: allowed in a cluster file's
# `hostname` (what `flashflex profile` recorded there), never in --hosts.
_LABEL_UNDERSCORE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_SCOPE = re.compile(r"^[A-Za-z0-9_.\-]{1,15}$")  # an IPv6 zone: an interface name (IFNAMSIZ - 1 characters)
MAX_HOST_NAME = 253


def host_problem(text: str, underscores: bool = False) -> str | None:
    """Why `text` is not a host name or IP address ('is not ...'), or None when it is one."""
    if not text.isprintable():
        return "holds control characters"
    if "%" in text:  # an IPv6 address with a zone, fe80::1%eth0
        address, _, scope = text.partition("%")
        if _SCOPE.match(scope) and _is_ip(address, version=6):
            return None
        return "is not a host name or IP address (a zone index follows only an IPv6 address, as in fe80::1%eth0)"
    if _is_ip(text):
        return None
    if ":" in text:
        return "is not a valid IPv6 address"
    name = text[:-1] if text.endswith(".") else text  # a fully qualified name may end with the root's dot
    if not name or len(name) > MAX_HOST_NAME:
        return f"is not a host name (1 to {MAX_HOST_NAME} characters)"
    labels = name.split(".")
    if all(label.isdigit() for label in labels):
        return "is not a valid IPv4 address"
    pattern = _LABEL_UNDERSCORE if underscores else _LABEL
    if not all(pattern.match(label) for label in labels):
        allowed = "letters, digits, '-'" + (" and '_'" if underscores else "")
        return (f"is not a host name or IP address (RFC 1123: dot-separated labels of {allowed}, 1-63 characters "
                "each, not starting or ending with '-')")
    return None


def _is_ip(text: str, version: int | None = None) -> bool:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    return version is None or address.version == version


def url_host(host: str) -> str:
    """`host` as it stands before ':PORT' in an endpoint: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host
