"""The holder's parts in-process: its crash backoff (virtual time), its channel to serving
processes, its control socket, and its own answers to the kernel on a real FUSE mount."""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import threading
from pathlib import Path

import pytest

from decodefs.common import channel
from decodefs.common.mounts import find_mount
from decodefs.common.runtime import holder_socket_path
from decodefs.holder import ControlError, HolderUnreachable, ask_holder, kernel, state
from decodefs.holder.backoff import MAX_DELAY, WINDOW, CrashBackoff
from decodefs.holder.control import ControlConnection, listen
from decodefs.holder.kernel import FuseConnection, answer_with_eio
from decodefs.holder.loop import EventLoop
from tests.conftest import needs_root
from tests.helpers import NOBODY, errno_of, python_as_nobody, unmount_quietly


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_crash_now_and_then_restarts_at_once_a_crash_loop_backs_off_and_is_forgotten() -> None:
    clock = Clock()
    backoff = CrashBackoff(clock)
    assert backoff.crashed() == 0.0  # the OOM killer, once
    clock.now += 10
    assert backoff.crashed() == 0.0
    delays = []
    for _ in range(8):
        clock.now += 0.5
        delays.append(backoff.crashed())
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, MAX_DELAY, MAX_DELAY]
    assert backoff.recent == 10
    clock.now += WINDOW + 1  # a minute of serving: the loop is over
    assert backoff.recent == 0
    assert backoff.crashed() == 0.0
    assert backoff.crashed() == 0.0 and backoff.crashed() == 1.0
    backoff.forget()  # the last one served a while before it died: a one-off
    assert backoff.crashed() == 0.0


def test_a_state_directory_is_removed_once_its_holder_is_gone_not_while_one_makes_it(
    tmp_path: Path,
) -> None:
    """Two mounts starting at once: one's state directory, made but its holder's pid
    not yet written, is not the other's to remove (the daemon failed to start, ENOENT)."""
    dead = os.fork()  # a holder that exited
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    made = {"live": str(os.getpid()), "dead": str(dead), "making": None, "abandoned": None}
    for name, pid in made.items():
        (tmp_path / name).mkdir()
        if pid is not None:
            (tmp_path / name / "holder.pid").write_text(f"{pid}\n")
    now = os.stat(tmp_path / "making").st_mtime + 1
    abandoned = now - state._MAKING_SECONDS - 1
    os.utime(tmp_path / "abandoned", (abandoned, abandoned))
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        state._remove_orphans(root, str(tmp_path), now)
    finally:
        os.close(root)
    assert sorted(os.listdir(tmp_path)) == ["live", "making"]


def test_a_repeating_timer_runs_at_its_interval_until_it_is_cancelled_even_by_itself() -> None:
    clock = Clock()
    loop = EventLoop(clock)
    ran: list[float] = []

    def tick() -> None:
        ran.append(clock.now)
        if len(ran) == 3:
            loop.cancel("tick")  # from within: no fourth

    loop.every("tick", 2.0, tick)
    for _ in range(3):
        assert loop.pending("tick") == 2.0
        clock.now += 2.0
        loop.step()  # due already: no wait
    assert ran == [1002.0, 1004.0, 1006.0]
    assert loop.pending("tick") is None  # nothing left to run
    loop.close()


def test_messages_carry_descriptors_and_a_gone_peer_is_said() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_end, write_end = os.pipe()
    try:
        init = bytes(range(256)) * 3
        channel.send(ours, channel.HELLO, [read_end], init=channel.encode_bytes(init), first=True)
        message = channel.receive(theirs)
        assert message.kind == channel.HELLO and message.get("first") is True
        assert channel.decode_bytes(message.get("init")) == init
        assert len(message.fds) == 1 and message.fds[0] != read_end
        os.write(write_end, b"x")
        assert os.read(message.fds[0], 1) == b"x"  # the same pipe, passed along
        os.close(message.fds[0])
        theirs.send(b"not json")
        with pytest.raises(ValueError):
            channel.receive(ours)
        theirs.close()
        with pytest.raises(channel.ChannelClosed):
            channel.receive(ours)
        with pytest.raises(channel.ChannelClosed):
            channel.send(ours, channel.PING)
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        ours.close()


def test_the_control_socket_answers_its_owner_and_refuses_a_bad_request(tmp_path: Path) -> None:
    mountpoint = str(tmp_path / "mnt")
    with pytest.raises(HolderUnreachable):
        ask_holder(mountpoint, "status", timeout=5)
    server = listen(mountpoint)
    try:
        assert oct(os.stat(holder_socket_path(mountpoint)).st_mode & 0o777) == "0o600"
        answers: list[object] = []

        def serve(count: int) -> None:
            for _ in range(count):
                server.setblocking(True)
                sock, _ = server.accept()
                connection = ControlConnection(sock)
                assert connection.allowed and connection.peer_uid == os.geteuid()
                request = None
                while request is None:
                    try:
                        request = connection.read_request()
                    except ValueError as exc:
                        connection.answer({"ok": False, "error": f"bad request: {exc}"})
                        break
                else:
                    answers.append(request)
                    connection.answer({"ok": True, "holder": {"pid": 1}})

        thread = threading.Thread(target=serve, args=(2,))
        thread.start()
        assert ask_holder(mountpoint, "status", timeout=5)["holder"] == {"pid": 1}
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(holder_socket_path(mountpoint))
            raw.sendall(b'{"command": "rm -rf"}\n')
            assert b"bad request" in raw.recv(4096)
        thread.join(timeout=10)
        assert answers == [{"command": "status"}]
        with pytest.raises(FileExistsError):  # a second holder for the same mount point
            threading.Thread(target=serve, args=(1,)).start()
            listen(mountpoint)
    finally:
        server.close()
        os.unlink(holder_socket_path(mountpoint))
    with pytest.raises(ControlError):
        raise ControlError("the holder refused")


@needs_root
def test_another_user_cannot_reach_roots_holder(tmp_path: Path) -> None:
    mountpoint = str(tmp_path / "mnt")
    server = listen(mountpoint)
    try:
        script = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "except OSError as exc:\n"
            "    print(exc.errno)\n"
        )
        done = python_as_nobody(script, holder_socket_path(mountpoint))
        assert done.stdout.strip() == str(errno.EACCES).encode(), done
    finally:
        server.close()
        os.unlink(holder_socket_path(mountpoint))
    assert os.geteuid() != NOBODY


@needs_root
def test_while_no_serving_process_runs_the_holder_answers_each_request_eio(
    tmp_path: Path,
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    connection = FuseConnection.mount(str(mountpoint), allow_other=False)
    try:
        assert connection.init.protocol.startswith("7.")
        # The kernel sends nothing else before INIT is answered: answer it as a serving
        # process would (a minimal fuse_init_out), then let the holder answer the rest.
        unique = struct.unpack_from("<Q", connection.init.data, 8)[0]
        body = struct.pack("<IIIIHHIIHHI", 7, 31, 0, 0, 12, 9, 4096, 1, 1, 0, 0).ljust(64, b"\0")
        connection.answer_init(struct.pack("<IiQ", 16 + len(body), 0, unique) + body)
        errors: list[int] = []
        thread = threading.Thread(
            target=lambda: errors.append(errno_of(os.stat, mountpoint / "v1"))
        )
        thread.start()
        opcodes = []
        while thread.is_alive():
            readable, _, _ = select.select([connection.fd], [], [], 0.05)
            if readable:
                opcode = answer_with_eio(connection.fd)
                if opcode is not None:
                    opcodes.append(opcode)
        assert errors == [errno.EIO]
        assert opcodes and set(opcodes) <= {1, 3}  # LOOKUP, GETATTR: each answered once
    finally:
        connection.close()
        unmount_quietly(mountpoint)


@needs_root
def test_a_user_mounts_through_fusermount3_which_passes_the_connection_back(
    tmp_path: Path,
) -> None:
    """What a holder that is not root does (here as root, which fusermount3 also serves):
    fusermount3 mounts and passes /dev/fuse back over the socket libfuse would use."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    fd = kernel._fusermount(str(mountpoint), kernel.mount_options(allow_other=False))
    try:
        info = find_mount(str(mountpoint))
        assert info is not None and info.fstype == "fuse.decodefs"
        data = os.read(fd, kernel.READ_BUFFER)
        assert struct.unpack_from("<I", data, 4)[0] == 26  # the kernel's INIT, on our descriptor
    finally:
        os.close(fd)
        unmount_quietly(mountpoint)


def test_access_originals_is_refused_before_a_mount_unless_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 61234)
    problem = kernel.mount_problem("originals")
    assert problem is not None and problem.startswith('access = "originals" needs root')
    assert 'set access = "owner" or "everyone"' in problem
    assert kernel.mount_options(allow_other=True)[-1] == "allow_other"
    assert "default_permissions" in kernel.mount_options(allow_other=False)
