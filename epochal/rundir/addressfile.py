"""The coordinator's address in a file: how workers find a coordinator that bound port 0.

``epochal coordinator --address-file PATH`` binds (port 0 is fine), then writes the address other
machines connect to, ``tcp://HOST:PORT``, to PATH atomically (temp file, fsync, rename), so a reader
sees either nothing or the whole line. PATH's directory may be shared by design (a job's directory
on a shared file system), so it is not required to be private; but the file is written as every file
of a run is, never through a link (:func:`epochal.rundir.files.write_atomic`), and read only when it
is a regular file of at most :data:`ADDRESS_LIMIT` bytes, so a link or a FIFO planted there neither
redirects the write nor hangs a worker. A worker started with
``EPOCHAL_COORDINATOR=file:PATH`` waits for the file and reads it. This is what a batch job uses on
a shared file system, where no port can be fixed in advance.

The address written is never a wildcard: a coordinator bound to ``0.0.0.0`` writes
``EPOCHAL_HOST`` when set, else the address of the interface of the default route, else the
non-loopback address the host name resolves to, else the first non-loopback interface address.
No packet is sent to find it. No torch here: the coordinator uses this module.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from epochal.environment import HOST_ENV
from epochal.errors import ConfigError, CoordinatorUnreachable
from epochal.rundir.files import NotRegular, read_regular, write_atomic

FILE_SCHEME = "file:"
"""``EPOCHAL_COORDINATOR=file:PATH``: read the coordinator's address from PATH."""

POLL_INTERVAL = 0.1

ADDRESS_LIMIT = 4096
"""The largest address file read: one endpoint and a newline."""
"""Seconds between looks at an address file that does not exist yet."""

_SIOCGIFADDR = 0x8915
_WILDCARDS = ("0.0.0.0", "::", "*", "")


def interface_addresses() -> dict[str, str]:
    """Every interface of this machine that has an IPv4 address, by name (Linux ioctl)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # down, or no IPv4 address
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def default_route_interface(route_table: str | None = None) -> str | None:
    """The interface of the IPv4 default route, from ``/proc/net/route``; None when none."""
    if route_table is None:
        try:
            route_table = Path("/proc/net/route").read_text()
        except OSError:
            return None
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def _not_loopback(address: str) -> bool:
    try:
        return not ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def pick_address(
    *,
    explicit: str,
    route: str | None,
    host_name: Sequence[str],
    interfaces: Sequence[str],
) -> str | None:
    """The rule: ``explicit`` (EPOCHAL_HOST), else the default route's interface address, else
    the first non-loopback address the host name resolves to, else the first non-loopback
    interface address; None when there is none."""
    if explicit:
        return explicit
    candidates = ([route] if route is not None else []) + list(host_name) + list(interfaces)
    return next((a for a in candidates if _not_loopback(a)), None)


def local_address(env: Mapping[str, str] | None = None) -> str:
    """The address of this machine that other machines can reach (see the module docstring)."""
    env = os.environ if env is None else env
    explicit = env.get(HOST_ENV, "")
    route = None if explicit else default_route_interface()
    try:
        infos = [] if explicit else socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    interfaces = {} if explicit else interface_addresses()
    address = pick_address(
        explicit=explicit,
        route=interfaces.get(route) if route is not None else None,
        host_name=[str(info[4][0]) for info in infos],
        interfaces=list(interfaces.values()),
    )
    if address is None:
        raise ConfigError(
            "this machine has no address other machines could reach (no default route, the host "
            f"name resolves to loopback, no interface has another address): set {HOST_ENV} to "
            "the address workers should connect to"
        )
    return address


def connectable(endpoint: str, env: Mapping[str, str] | None = None) -> str:
    """``endpoint`` as workers elsewhere dial it: a wildcard host becomes this machine's address."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        return endpoint
    host = parts.hostname or ""
    if host not in _WILDCARDS:
        return endpoint
    address = local_address(env)
    if ":" in address:
        address = f"[{address}]"
    return f"tcp://{address}:{parts.port}"


def write(path: Path, endpoint: str) -> None:
    """Write ``endpoint`` and a newline to ``path`` atomically: a new file (exclusively created,
    mode 0600, never through a link), fsync, rename, fsync of the directory."""
    write_atomic(Path(path), endpoint + "\n")


def _read(path: Path) -> str:
    return read_regular(path, ADDRESS_LIMIT).decode("utf-8", errors="replace").strip()


def remove_if_ours(path: Path, endpoint: str) -> None:
    """Remove the address file if it still holds ``endpoint`` (a successor may have replaced it)."""
    try:
        if _read(Path(path)) == endpoint:
            Path(path).unlink()
    except OSError:
        pass


def file_path(spec: str) -> Path | None:
    """The path in ``file:PATH``; None when ``spec`` is an endpoint, not a file reference."""
    if not spec.startswith(FILE_SCHEME):
        return None
    path = spec[len(FILE_SCHEME) :]
    if path.startswith("//"):
        path = path[2:]
    if not path:
        raise ConfigError(f"{spec!r} names no file: use file:/shared/dir/coordinator.addr")
    return Path(path)


def wait_for(
    path: Path,
    timeout: float,
    *,
    say: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Wait up to ``timeout`` seconds for the address file at ``path`` and return its address.

    ``say`` is told once when the file is not there yet.
    """
    deadline = clock() + timeout
    told = False
    while True:
        try:
            text = _read(Path(path))
        except FileNotFoundError:
            text = ""
        except NotRegular as exc:
            raise ConfigError(
                f"the coordinator's address file is unusable: {exc}; the coordinator writes a "
                "regular file there: remove what is there and start it again, or give another "
                "--address-file"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot read the coordinator's address file {path}: {exc}") from None
        if text:
            return text
        if clock() >= deadline:
            raise CoordinatorUnreachable(
                f"the coordinator's address file {path} did not appear within {timeout:g} s: "
                "start the coordinator with --address-file pointing at the same path (on a file "
                "system every worker sees), or raise EPOCHAL_CONNECT_TIMEOUT"
            )
        if not told and say is not None:
            say(f"waiting up to {timeout:g} s for the coordinator's address in {path}")
            told = True
        sleep(min(POLL_INTERVAL, max(0.0, deadline - clock())))
