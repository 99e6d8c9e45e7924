"""Hosts on a network of their own, for the cluster tests and benchmark: one network
namespace per host, each joined to one bridge by a veth pair, made and always removed.

Needs root, ``ip`` and ``nsenter``. The host machine has no address on the bridge,
so only the namespaces talk over it. A process is started in a host's namespace
with ``nsenter --net=...``, which keeps the machine's mount namespace: a FUSE mount
made there is visible to every reader (``ip netns exec`` would give it a mount
namespace of its own). ``Network.within`` runs Python calls on a thread of this
process that lives in a host's namespace (a client of a server there). Every name
begins with the given prefix plus a random tag; a reaper process removes them all if
this process dies before it could.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

T = TypeVar("T")
_CLONE_NEWNET: Final = 0x40000000  # setns(2)


@dataclass(frozen=True)
class Host:
    namespace: str  # /run/netns/<namespace>
    address: str  # its IPv4 address on the bridge
    link: str  # the machine's end of its veth pair: set it down to cut the host off

    def command(self, *argv: str) -> list[str]:
        """``argv`` run in this host's network namespace (and the machine's mounts)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace}", *argv]


@dataclass
class Network:
    tag: str
    bridge: str
    hosts: dict[str, Host] = field(default_factory=dict)
    _executors: dict[str, concurrent.futures.ThreadPoolExecutor] = field(default_factory=dict)

    def cut(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "up")

    def within(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread of this process that lives in host ``name``'s namespace."""
        executor = self._executors.get(name)
        if executor is None:
            path = f"/run/netns/{self.hosts[name].namespace}"
            executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"netns-{name}", initializer=_enter, initargs=(path,)
            )
            self._executors[name] = executor
        return executor.submit(fn).result()

    def cleanup_commands(self) -> list[list[str]]:
        commands = [["ip", "link", "del", host.link] for host in self.hosts.values()]
        commands += [["ip", "netns", "del", host.namespace] for host in self.hosts.values()]
        return [*commands, ["ip", "link", "del", self.bridge]]

    def remove(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        for command in self.cleanup_commands():
            subprocess.run(command, capture_output=True, check=False)


@contextlib.contextmanager
def network(prefix: str, names: Sequence[str]) -> Iterator[Network]:
    """A bridge and one namespace per name (``<prefix><tag>-<name>``), removed afterwards
    even on failure; the processes started in them must be stopped first."""
    tag = prefix + secrets.token_hex(2)  # interface names: at most 15 characters
    subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250)}"
    net = Network(tag, f"{tag}br")
    for i, name in enumerate(names):
        net.hosts[name] = Host(f"{tag}-{name}", f"{subnet}.{i + 1}", f"{tag}v{i}")
    reaper = _reaper(net)
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("link", "set", net.bridge, "up")
        for i, host in enumerate(net.hosts.values()):
            peer = f"{tag}p{i}"
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.namespace)
            _ip("link", "set", host.link, "master", net.bridge, "up")
            inside = ["ip", "-n", host.namespace]
            _run([*inside, "link", "set", peer, "name", "eth0"])
            _run([*inside, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            _run([*inside, "link", "set", "eth0", "up"])
            _run([*inside, "link", "set", "lo", "up"])
        yield net
    finally:
        try:
            net.remove()
        finally:
            assert reaper.stdin is not None
            reaper.stdin.close()
            reaper.wait(timeout=60)


def _reaper(net: Network) -> subprocess.Popen[bytes]:
    """A process that removes the network once this one's end of its pipe closes: at
    the end, or when this process dies (a timeout's os._exit) and no finally runs."""
    script = "cat >/dev/null; " + "; ".join(
        " ".join(command) + " 2>/dev/null" for command in net.cleanup_commands()
    )
    return subprocess.Popen(
        ["sh", "-c", script + "; true"], stdin=subprocess.PIPE, start_new_session=True
    )


def _enter(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
    finally:
        os.close(fd)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(command: list[str]) -> Any:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
    return result
