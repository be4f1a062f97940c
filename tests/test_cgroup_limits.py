"""A cgroup's limits (folio.cgroup_limits), read from cgroup v2 and v1 files laid out as the kernel mounts them: its
CPU quota caps folio's default thread count, its memory limit the memory the KV cache's default is sized from."""

from __future__ import annotations

from pathlib import Path

from folio import cgroup_limits, memory, thread_count

GIB = 1 << 30


def tree(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return root, tmp_path / "membership"


def test_cgroup_v2_cpu_quotas(tmp_path):
    root, membership = tree(tmp_path, "0::/pod/app\n", {"pod/app/cpu.max": "200000 100000\n"})
    assert cgroup_limits.cpu_limit(root, membership) == 2
    (root / "pod/app/cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: two threads, the second half-used
    assert cgroup_limits.cpu_limit(root, membership) == 2
    (root / "pod/app/cpu.max").write_text("max 100000\n")
    assert cgroup_limits.cpu_limit(root, membership) is None
    (root / "pod/cpu.max").write_text("100000 100000\n")  # a parent's quota holds for the cgroups below it
    assert cgroup_limits.cpu_limit(root, membership) == 1


def test_a_containers_own_namespace_reads_the_mounts_root(tmp_path):
    root, membership = tree(tmp_path, "0::/\n", {"cpu.max": "400000 100000\n"})
    assert cgroup_limits.cpu_limit(root, membership) == 4
    root, membership = tree(tmp_path / "ns", "0::/not/here\n", {"cpu.max": "300000 100000\n"})
    assert cgroup_limits.cpu_limit(root, membership) == 3


def test_cgroup_v1_cpu_quotas(tmp_path):
    files = {"cpu,cpuacct/job/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}
    root, membership = tree(tmp_path, "4:memory:/job\n3:cpu,cpuacct:/job\n", files)
    assert cgroup_limits.cpu_limit(root, membership) == 3
    (root / "cpu,cpuacct/job/cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_limits.cpu_limit(root, membership) is None


def test_memory_limits_less_the_usage_that_cannot_be_reclaimed(tmp_path):
    v2 = {"app/memory.max": f"{8 * GIB}\n", "app/memory.current": f"{3 * GIB}\n",
          "app/memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}\n"}
    root, membership = tree(tmp_path, "0::/app\n", v2)
    assert cgroup_limits.memory_headroom(root, membership) == 6 * GIB  # 8 less 3 in use, of which 1 reclaimable
    (root / "app/memory.max").write_text("max\n")
    assert cgroup_limits.memory_headroom(root, membership) is None
    v1 = {"memory/job/memory.limit_in_bytes": f"{4 * GIB}\n", "memory/job/memory.usage_in_bytes": f"{GIB}\n",
          "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": f"{9 * GIB}\n"}
    root, membership = tree(tmp_path / "v1", "7:memory:/job\n3:cpu:/job\n", v1)
    assert cgroup_limits.memory_headroom(root, membership) == 3 * GIB
    assert cgroup_limits.cpu_limit(root, membership) is None
    (tmp_path / "v1/membership").write_text("7:memory:/\n")  # the root alone: its "no limit" is none
    assert cgroup_limits.memory_headroom(root, tmp_path / "v1/membership") is None


def test_nothing_to_read_is_no_limit(tmp_path):
    assert cgroup_limits.cpu_limit(tmp_path, tmp_path / "missing") is None
    assert cgroup_limits.memory_headroom(tmp_path, tmp_path / "missing") is None
    root, membership = tree(tmp_path, "0::/a\n", {"a/cpu.max": "garbled\n", "a/memory.max": "garbled\n"})
    assert cgroup_limits.cpu_limit(root, membership) is None
    assert cgroup_limits.memory_headroom(root, membership) is None


def test_the_default_thread_count_keeps_within_the_quota(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(thread_count, "cores", lambda: 64)
    monkeypatch.setattr(cgroup_limits, "cpu_limit", lambda: 2)
    assert thread_count.default() == 2
    monkeypatch.setattr(cgroup_limits, "cpu_limit", lambda: None)
    assert thread_count.default() == 64
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's count stands
    assert thread_count.default() == 3


def test_available_memory_keeps_within_the_limit(monkeypatch):
    monkeypatch.setattr(cgroup_limits, "memory_headroom", lambda: None)
    assert memory.available_memory_bytes() > 1 << 20
    monkeypatch.setattr(cgroup_limits, "memory_headroom", lambda: 1 << 20)  # a container with 1 MiB left
    assert memory.available_memory_bytes() == 1 << 20
