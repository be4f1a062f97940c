"""A cgroup's CPU quota caps folio's default thread count (folio.cpu_quota), read from cgroup v2 and v1 files laid
out as the kernel mounts them."""

from __future__ import annotations

from pathlib import Path

from folio import cpu_quota, thread_count


def tree(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return root, tmp_path / "membership"


def test_cgroup_v2_quotas(tmp_path):
    root, membership = tree(tmp_path, "0::/pod/app\n", {"pod/app/cpu.max": "200000 100000\n"})
    assert cpu_quota.limit(root, membership) == 2
    (root / "pod/app/cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: two threads, the second half-used
    assert cpu_quota.limit(root, membership) == 2
    (root / "pod/app/cpu.max").write_text("max 100000\n")
    assert cpu_quota.limit(root, membership) is None
    (root / "pod/cpu.max").write_text("100000 100000\n")  # a parent's quota holds for the cgroups below it
    assert cpu_quota.limit(root, membership) == 1


def test_a_containers_own_namespace_reads_the_mounts_root(tmp_path):
    root, membership = tree(tmp_path, "0::/\n", {"cpu.max": "400000 100000\n"})
    assert cpu_quota.limit(root, membership) == 4
    root, membership = tree(tmp_path / "ns", "0::/not/here\n", {"cpu.max": "300000 100000\n"})
    assert cpu_quota.limit(root, membership) == 3


def test_cgroup_v1_quotas(tmp_path):
    files = {"cpu,cpuacct/job/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}
    root, membership = tree(tmp_path, "4:memory:/job\n3:cpu,cpuacct:/job\n", files)
    assert cpu_quota.limit(root, membership) == 3
    (root / "cpu,cpuacct/job/cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota.limit(root, membership) is None


def test_nothing_to_read_is_no_quota(tmp_path):
    assert cpu_quota.limit(tmp_path, tmp_path / "missing") is None
    root, membership = tree(tmp_path, "0::/a\n", {"a/cpu.max": "garbled\n"})
    assert cpu_quota.limit(root, membership) is None


def test_the_default_thread_count_keeps_within_the_quota(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(thread_count, "cores", lambda: 64)
    monkeypatch.setattr(cpu_quota, "limit", lambda: 2)
    assert thread_count.default() == 2
    monkeypatch.setattr(cpu_quota, "limit", lambda: None)
    assert thread_count.default() == 64
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's count stands
    assert thread_count.default() == 3
