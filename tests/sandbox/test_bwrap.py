"""The bubblewrap sandbox through its seam (harness/sandbox/): limits that reach what runs inside, the workspace's
put and get, a hanging sandbox that is killed whole, and the one-line error when a workdir is not a workspace."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from harness.running.limits import cgroup_root, pids_root
from harness.sandbox import SandboxError, SandboxSpec, open_backend
from tests.support import running_with

PIPE = asyncio.subprocess.PIPE


@pytest.fixture(scope="module")
def backend():
    return open_backend("bwrap")


async def test_the_limits_reach_every_process_inside(backend, tmp_path):
    spec = SandboxSpec(memory_mb=1536, max_procs=48, cpus=0.5)
    box = await backend.open(spec, tmp_path / "ws")
    try:
        proc = await box.exec(["sh", "-c", "grep 'Max data size' /proc/self/limits; echo ready; sleep 600"],
                              env=dict(os.environ), stdout=PIPE)
        limits = (await proc.stdout.readline()).decode()
        assert await proc.stdout.readline() == b"ready\n"
        assert limits.split()[3] == str(1536 * 1024 * 1024), limits  # the shell's own, inherited from bwrap's
        group = f"harness-{proc.pid}"  # the limits wrapper execs bwrap: its pid names the groups
        if (pids := pids_root()) is not None:
            assert (pids / group / "pids.max").read_text().strip() == "48"
        if (cpu := cgroup_root("cpu")) is not None:
            quota = cpu / group / "cpu.cfs_quota_us"
            assert (quota.read_text().strip() if quota.exists() else
                    (cpu / group / "cpu.max").read_text().split()[0]) == "50000"
    finally:
        await box.close()
    assert proc.returncode is not None
    for root in (pids_root(), cgroup_root("cpu")):
        assert root is None or not (root / f"harness-{proc.pid}").exists()  # released with the sandbox


async def test_put_and_get_reach_the_workspace_only(backend, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("from the host\n")
    box = await backend.open(SandboxSpec(workdir="/work/space"), tmp_path / "ws")
    try:
        box.put(source, "/work/space/sub/in.txt")
        proc = await box.exec(["sh", "-c", "pwd; cat sub/in.txt; echo made > out.txt"], env=dict(os.environ),
                              stdout=PIPE)
        out, _ = await proc.communicate()
        assert out.decode().splitlines() == ["/work/space", "from the host"]
        assert box.get("/work/space/out.txt") == b"made\n"
        proc = await box.exec(["ln", "-s", str(source), "link"], env=dict(os.environ))
        assert await proc.wait() == 0
        for outside in ("/etc/passwd", "/work/space/../x", "/work/spaced/x", "/work/space/link"):
            with pytest.raises(SandboxError, match="workspace"):
                box.get(outside)  # a link the sandbox made to a host file is not followed on the host
        with pytest.raises(SandboxError, match="workspace"):
            box.put(source, "/work/space/link")
    finally:
        await box.close()
    assert (tmp_path / "ws" / "out.txt").read_text() == "made\n"  # the workspace outlives its sandbox
    with pytest.raises(SandboxError, match="closed"):
        await box.exec(["true"], env={})


async def test_a_closed_sandbox_leaves_nothing_running(backend, tmp_path):
    marker = f"harness-sandbox-test-{os.getpid()}"
    box = await backend.open(SandboxSpec(binds=(sys.prefix,)), tmp_path / "ws")  # this venv's python
    code = (f"import subprocess, time; subprocess.Popen(['sh', '-c', 'sleep 3600; : {marker}'], "
            "start_new_session=True); print('started', flush=True); time.sleep(3600)")
    proc = await box.exec([sys.executable, "-c", code], env=dict(os.environ), stdout=PIPE)
    assert await proc.stdout.readline() == b"started\n"
    assert running_with(marker)
    await box.close()
    for _ in range(200):  # the kernel tears the PID namespace down after bwrap is killed
        if not running_with(marker):
            break
        await asyncio.sleep(0.05)
    assert not running_with(marker)


def test_a_workdir_must_be_a_directory_of_its_own():
    for bad in ("app", "/", "/usr", "/tmp/", "/run/harness", "/proc/x", "/tests", "/logs/verifier", "/app/../etc"):
        with pytest.raises(SandboxError, match="cannot be a sandbox's workspace"):
            SandboxSpec(workdir=bad)


def test_an_unknown_backend_is_named():
    with pytest.raises(SandboxError, match="unknown sandbox 'docker'"):
        open_backend("docker")
