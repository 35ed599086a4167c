"""The file tools (`tt.tools.read_file`, `write_file`, `list_dir`): in the current sandbox (a
real `local` box), or in a `root` folder on the host; a path never leaves the work folder
(``..``, an absolute path, a symlink out), and the model reads why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

import trio_tasksets as tt


async def call(tool: tt.Tool, **arguments: object) -> str:
    value = await tool.call(arguments)
    assert isinstance(value, str)
    return value


async def test_the_file_tools_work_in_the_current_sandbox() -> None:
    write, read, listing = tt.tools.write_file(), tt.tools.read_file(), tt.tools.list_dir()
    with trio.fail_after(30):
        async with tt.sandboxes.open_sandbox(tt.sandboxes.local()) as box:
            with tt.sandboxes.using(box):
                assert await call(write, path="a/b.txt", content="héllo") == (
                    "wrote 6 bytes to a/b.txt"
                )
                assert await call(read, path="a/b.txt") == "héllo"
                assert await box.read_file("a/b.txt") == "héllo".encode()  # the box's own file
                await box.exec("mkdir c && ln -s /etc out && ln -s a in")
                assert (await call(listing)).split() == ["a/", "c/", "in", "out"]
                assert await call(listing, path="in") == "b.txt"  # a symlink inside: fine
                assert await call(listing, path="c") == "[empty folder]"
                for escape in ("out", "..", "/etc", "a/../.."):
                    with pytest.raises((OSError, tt.sandboxes.SandboxError)):
                        await call(listing, path=escape)
                for escape in ("../x", "/etc/passwd"):
                    with pytest.raises(tt.sandboxes.SandboxError):
                        await call(read, path=escape)
                    with pytest.raises(tt.sandboxes.SandboxError):
                        await call(write, path=escape, content="x")


async def test_without_a_sandbox_they_work_in_their_root_folder(tmp_path: Path) -> None:
    root = tmp_path / "work"
    root.mkdir()
    (tmp_path / "secret").write_text("no")
    os.symlink(tmp_path / "secret", root / "link")
    write, read = tt.tools.write_file(root=root), tt.tools.read_file(root=root, max_bytes=4)
    listing = tt.tools.list_dir(root=root, max_entries=2)
    await call(write, path="x/y.txt", content="0123456789")
    assert (root / "x" / "y.txt").read_text() == "0123456789"
    assert await call(read, path="x/y.txt") == "0123\n[file truncated: 6 more bytes]"
    await call(write, path="z", content="")
    assert await call(listing) == "link\nx/\n[1 more entries]"
    for escape in ("link", "../secret", str(tmp_path / "secret")):
        with pytest.raises(PermissionError, match="outside the work folder"):
            await call(read, path=escape)
    with pytest.raises(PermissionError, match="outside the work folder"):
        await call(write, path="../evil", content="x")
    assert not (tmp_path / "evil").exists()
    with pytest.raises(ValueError, match="over the"):
        await call(tt.tools.write_file(root=root, max_bytes=3), path="big", content="four")


async def test_with_neither_they_say_there_is_no_sandbox() -> None:
    with pytest.raises(PermissionError, match="no sandbox is current"):
        await call(tt.tools.read_file(), path="a")


def test_bad_options_name_their_parameter(tmp_path: Path) -> None:
    with pytest.raises(tt.ConfigError) as caught:
        tt.tools.read_file(root=tmp_path / "missing")
    assert caught.value.parameter == "root"
    with pytest.raises(tt.ConfigError) as caught:
        tt.tools.write_file(max_bytes=0)
    assert caught.value.parameter == "max_bytes"
    with pytest.raises(tt.ConfigError) as caught:
        tt.tools.list_dir(max_entries=True)
    assert caught.value.parameter == "max_entries"
