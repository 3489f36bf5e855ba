"""The address this node gives its peers, and the network interface behind it.

torchrun's agents and gloo otherwise advertise the machine's hostname, which rented boxes rarely resolve for
each other: peers then wait out every timeout connecting to a name they cannot look up (or to 127.0.1.1,
what Debian's /etc/hosts maps a hostname to). A node advertises instead the local address its kernel routes
to the rendezvous endpoint, which is reachable from node 0 whenever node 0 is reachable from it, unless
ADVERTISE_ADDR says otherwise; gloo and NCCL use the interface that holds it.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct

from train.errors import ConfigError

ADVERTISE_VARIABLE = "ADVERTISE_ADDR"
_SIOCGIFADDR = 0x8915


def route_source(host: str, port: int) -> str:
    """The local address the kernel would send from to reach ``host`` (no packet is sent: a UDP socket's
    connect only picks a route)."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except OSError as e:
        raise ConfigError(
            f"RDZV_ENDPOINT host {host!r} does not resolve on this node ({e}): use node 0's IP address"
        ) from None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(where)
        except OSError as e:
            raise ConfigError(f"no route from this node to the rendezvous host {host} ({e.strerror or e})") from None
        return probe.getsockname()[0]


def advertised_address(environ: dict[str, str] | os._Environ, endpoint_host: str, port: int) -> str:
    """ADVERTISE_ADDR when set (it must be an address of this machine), else the route's source address."""
    chosen = environ.get(ADVERTISE_VARIABLE, "").strip()
    if not chosen:
        return route_source(endpoint_host, port)
    try:
        ipaddress.ip_address(chosen)
    except ValueError:
        raise ConfigError(f"{ADVERTISE_VARIABLE}={chosen!r} must be an IP address of this node") from None
    if chosen not in local_addresses():
        raise ConfigError(
            f"{ADVERTISE_VARIABLE}={chosen} is not an address of this node (it has {', '.join(local_addresses())})"
        )
    return chosen


def local_addresses() -> list[str]:
    """The IPv4 address of each network interface that has one."""
    return [a for _, a in _interfaces()]


def interface_of(address: str) -> str | None:
    """The network interface holding ``address`` (None for an IPv6 address or one no interface holds)."""
    return next((name for name, a in _interfaces() if a == address), None)


def _interfaces() -> list[tuple[str, str]]:
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            found.append((name, socket.inet_ntoa(request[20:24].tobytes())))
    return found


def is_public(address: str) -> bool:
    """Whether ``address`` is reachable from the internet (neither loopback nor a private or link-local range)."""
    try:
        return ipaddress.ip_address(address).is_global
    except ValueError:
        return False


def network_environ(address: str) -> dict[str, str]:
    """The variables that make gloo and NCCL use ``address``'s interface; empty when it is loopback (one
    machine) or no interface holds it. What the user set already is kept by the caller."""
    if ipaddress.ip_address(address).is_loopback:
        return {}
    name = interface_of(address)
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name} if name else {}
