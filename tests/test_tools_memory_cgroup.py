"""Where the Python tool's calls get their memory cgroups (archer/tools/memory_cgroup.py), from the /proc files of
hosts laid out as cgroup v1 + v2 (hybrid), v2 only under systemd, and a container; the real cgroups themselves are
checked by the hostile snippets of test_tools_python.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from archer.tools import memory_cgroup
from archer.tools.memory_cgroup import CgroupParent, candidates

HYBRID_MOUNTS = """\
30 25 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
36 30 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 30 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
"""
HYBRID_CGROUPS = "4:memory:/process_api/18ce\n1:cpu:/\n0::/\n"
SYSTEMD_MOUNTS = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
SYSTEMD_CGROUPS = "0::/user.slice/user-0.slice/session-3.scope\n"
# a container's own cgroup bind-mounted at /sys/fs/cgroup, its path seen from the host's namespace
CONTAINER_MOUNTS = r"40 35 0:30 /docker/abc /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw" + "\n"


def test_a_hybrid_host_offers_its_v2_root_and_its_v1_memory_cgroup() -> None:
    # in mount order; find_parent takes the first usable one (here v1: the v2 hierarchy has no memory controller)
    assert candidates(HYBRID_MOUNTS, HYBRID_CGROUPS) == [
        CgroupParent(Path("/sys/fs/cgroup/unified"), 2),  # the hierarchy's root: its own cgroup is "/"
        CgroupParent(Path("/sys/fs/cgroup/memory/process_api/18ce"), 1)]


def test_cgroup_v2_offers_the_own_cgroup_then_the_root() -> None:
    assert candidates(SYSTEMD_MOUNTS, SYSTEMD_CGROUPS) == [
        CgroupParent(Path("/sys/fs/cgroup/user.slice/user-0.slice/session-3.scope"), 2),
        CgroupParent(Path("/sys/fs/cgroup"), 2)]


def test_a_mount_of_part_of_the_hierarchy_maps_the_own_cgroup_into_it() -> None:
    assert candidates(CONTAINER_MOUNTS, "0::/docker/abc\n") == [CgroupParent(Path("/sys/fs/cgroup"), 2)]
    assert candidates(CONTAINER_MOUNTS, "0::/elsewhere\n") == [CgroupParent(Path("/sys/fs/cgroup"), 2)]
    assert candidates(r"41 35 0:31 / /mnt/my\040cgroups rw - cgroup cgroup rw,memory" + "\n", "5:memory:/a\n") == [
        CgroupParent(Path("/mnt/my cgroups/a"), 1)]  # mountinfo's octal escapes
    assert candidates("", "0::/\n") == []


def test_a_named_folder_that_is_no_cgroup_is_refused_with_the_reason(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory_cgroup.ENV, str(tmp_path))
    parent, reason = memory_cgroup.find_parent.__wrapped__()
    assert parent is None and f"{tmp_path} is not a cgroup folder" in reason and memory_cgroup.ENV in reason
    assert list(tmp_path.iterdir()) == []  # the trial cgroup folder is gone
