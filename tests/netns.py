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
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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


# Readers: THREADS threads in one process, started together once told to go; thread i
# reads every name, starting at its own place in the list. Prints the seconds from go
# to the last read and {name: [sha256 of each read]}.
_READERS = """
import concurrent.futures, hashlib, json, sys, time
from pathlib import Path
directory, threads, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def read(i):
    start = i * len(names) // threads
    order = names[start:] + names[:start]
    return [(n, hashlib.sha256((directory / n).read_bytes()).hexdigest()) for n in order]
print("ready", flush=True)
sys.stdin.readline()
started = time.perf_counter()
with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    seen = {}
    for pairs in pool.map(read, range(threads)):
        for name, digest in pairs:
            seen.setdefault(name, []).append(digest)
print(json.dumps({"seconds": time.perf_counter() - started, "digests": seen}))
"""


class Readers:
    """``threads`` readers of ``names`` under ``directory`` (a mount) in one process in
    ``host``'s namespace, ready to go. ``go`` starts them; ``result`` waits for them."""

    def __init__(self, host: Host, directory: Path, names: Sequence[str], threads: int):
        command = [sys.executable, "-c", _READERS, str(directory), str(threads), *names]
        self.process = subprocess.Popen(
            host.command(*command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.kill()
            raise RuntimeError(f"readers in {host.namespace} did not start: {line!r}")

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def done(self) -> bool:
        return self.process.poll() is not None

    def result(self, timeout: float) -> tuple[float, dict[str, list[str]]]:
        """Seconds the readers took, and name -> the sha256 of each read of it."""
        out, _ = self.process.communicate(timeout=timeout)
        if self.process.returncode != 0:
            raise RuntimeError(f"readers failed ({self.process.returncode}): {out[-2000:]}")
        result = json.loads(out)
        return float(result["seconds"]), result["digests"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def readers(
    groups: Sequence[tuple[Host, Path]], names: Sequence[str], threads: int
) -> Iterator[list[Readers]]:
    """One Readers per (host, directory), all ready; killed afterwards if still reading."""
    started: list[Readers] = []
    try:
        for host, directory in groups:
            started.append(Readers(host, directory, names, threads))
        yield started
    finally:
        for group in started:
            group.kill()


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
