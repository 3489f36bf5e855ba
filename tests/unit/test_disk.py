"""Which failed writes are a full disk: by errno, by text, and by the space left when the errno was lost."""

from __future__ import annotations

import errno

import pytest

from train.disk import MARGIN, as_disk_full, disk_full_error, human, looks_full, reserve
from train.errors import ConfigError, DiskFullError


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        OSError("Can't synchronously write data (file write failed: errno = 28, error message = 'No space ...')"),
    ],
)
def test_full_disks_are_known_by_errno_or_text(error):
    assert looks_full(error)


def test_a_full_disk_behind_another_error_is_found_through_the_chain():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("basic_ios::clear: iostream error") from inner
    except RuntimeError as outer:
        assert looks_full(outer)


def test_an_error_without_errno_is_a_full_disk_only_when_the_write_had_no_room(tmp_path):
    lost = RuntimeError("basic_ios::clear: iostream error")  # torch.save's C++ stream keeps no errno
    target = tmp_path / "step_00000004.pt"
    full = disk_full_error(lost, target, needed=200_000, free_before=4096, written=100_000)
    assert isinstance(full, DiskFullError) and full.exit_code == 4
    assert str(full).startswith(f"disk full: writing {target} needs 195.3 KiB, but its file system has ")
    assert full.path == target and full.needed == 200_000
    assert disk_full_error(lost, target, needed=200_000, free_before=MARGIN + 200_000) is None
    assert disk_full_error(lost, target) is None  # nothing measured: never a guess


def test_errors_a_user_can_act_on_are_never_taken_for_a_full_disk(tmp_path):
    assert disk_full_error(ConfigError("bad"), tmp_path / "x", free_before=0) is None
    assert as_disk_full(ConnectionResetError("peer gone"), tmp_path) is None  # on a full disk or not
    named = as_disk_full(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "m.jsonl")), tmp_path)
    assert named is not None and named.path == tmp_path / "m.jsonl"


def test_reserve_allocates_the_blocks_of_a_sparse_file(tmp_path):
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    assert path.stat().st_blocks * 512 < 1 << 20
    reserve(path)
    assert path.stat().st_blocks * 512 >= 1 << 20 and path.stat().st_size == 1 << 20


def test_sizes_for_people():
    assert [human(n) for n in (0, 512, 1536, 5 << 20, 3 << 30)] == ["0 B", "512 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"]
