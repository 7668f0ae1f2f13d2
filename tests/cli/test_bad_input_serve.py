"""Bad input to the verbs that serve or build (issue 48): `harness serve` and `harness view` on a taken port, a port
out of range, a database another process holds, a file that is not a database, a page open beyond this machine
without a token; `harness tiny-model` and `harness smollm2` on a path they cannot write. Each is fed through the
CLI as a user types it and answered with one line naming the value and what to do, before anything slow starts
(no engine log, no file written)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.store.database import Store


def _harness(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, **kwargs)


def _error_line(done: subprocess.CompletedProcess) -> str:
    """The one line the command printed on stderr (argparse's usage lines before its own error line aside)."""
    lines = done.stderr.splitlines()
    if lines and lines[0].startswith("usage:"):
        lines = [line for line in lines if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture
def taken_port():
    """A port another process would hold: a real socket bound and listening on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _hold(path: Path) -> subprocess.Popen:
    """Another process holding the database file, as a second proxy would: a real DuckDB connection, read-write."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, duckdb; con = duckdb.connect(sys.argv[1]); print('held', "
         "flush=True); time.sleep(600)", str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture
def harness_db(tmp_path) -> Path:
    path = tmp_path / "recorded.duckdb"
    Store.open(path).close()
    return path


def test_serve_with_a_model_refuses_a_taken_port_before_any_engine_starts(tiny_model_dir, tmp_path, taken_port):
    run_dir = tmp_path / "run"
    done = _harness("serve", "--model", str(tiny_model_dir), "--port", str(taken_port), "--run-dir", str(run_dir))
    assert done.returncode == 2
    line = _error_line(done)
    assert line.startswith(f"error: port {taken_port} on 127.0.0.1 is in use") and "--port N" in line, line
    assert not (run_dir / "engine.log").exists()  # vLLM writes its log there from its first moment
    assert "starting vLLM" not in done.stderr


def test_serve_with_a_model_beyond_loopback_needs_a_token_before_any_engine_starts(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    done = _harness("serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0",
                    "--run-dir", str(run_dir), env={"HARNESS_AUTH_TOKEN": ""})
    assert done.returncode == 2
    line = _error_line(done)
    assert "'0.0.0.0'" in line and "--auth-token" in line and "127.0.0.1" in line, line
    assert not (run_dir / "engine.log").exists()


def test_serve_with_a_model_refuses_llm_host_without_transparent_before_any_engine_starts(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    done = _harness("serve", "--model", str(tiny_model_dir), "--llm-host", "llm.example.com", "--port", "0",
                    "--run-dir", str(run_dir))
    assert done.returncode == 2
    assert _error_line(done) == "error: --llm-host and --refuse-other-hosts need --transparent"
    assert not (run_dir / "engine.log").exists() and "starting vLLM" not in done.stderr


def test_serve_record_only_refuses_a_taken_port(tmp_path, taken_port):
    done = _harness("serve", "--record-only", "--upstream", "http://127.0.0.1:9/v1", "--port", str(taken_port),
                    "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    line = _error_line(done)
    assert f"port {taken_port} on 127.0.0.1 is in use" in line and "--port N" in line, line
    assert not (tmp_path / "run" / "harness.duckdb").exists()


def test_serve_refuses_a_database_another_process_holds(tiny_model_dir, tmp_path, harness_db):
    holder = _hold(harness_db)
    try:
        run_dir = tmp_path / "run"
        done = _harness("serve", "--model", str(tiny_model_dir), "--db", str(harness_db), "--port", "0",
                        "--run-dir", str(run_dir))
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2
    line = _error_line(done)
    assert line == (f"error: {harness_db} is held by another process (pid {holder.pid}): stop it, or pass "
                    "--run-dir/--db elsewhere"), line
    assert not (run_dir / "engine.log").exists()


def test_a_port_or_database_taken_after_the_check_is_one_line_too(tmp_path, taken_port, harness_db, capsys):
    """Another process may take the port or the file between serve's check and the proxy's own bind and open
    (minutes apart with an engine starting): the proxy's failure is the same line, not a traceback."""
    from harness.cli.serve import _run_proxy
    from proxy.config import ProxyConfig

    def config(**given) -> ProxyConfig:
        return ProxyConfig(upstream_url="http://127.0.0.1:9/v1", returns_token_ids=False, token_exact=False,
                           record_only=True, **given)

    assert _run_proxy(config(db_path=tmp_path / "new.duckdb", port=taken_port), lambda server: None) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: port {taken_port} on 127.0.0.1 is in use (another process listens on it): pass --port N or stop "
        "the other process"]
    holder = _hold(harness_db)
    try:
        assert _run_proxy(config(db_path=harness_db, port=0), lambda server: None) == 2
    finally:
        holder.kill()
        holder.wait()
    assert capsys.readouterr().err.splitlines() == [
        f"error: {harness_db} is held by another process (pid {holder.pid}): stop it, or pass --run-dir/--db "
        "elsewhere"]


def test_serve_refuses_a_db_that_is_not_a_database(tmp_path):
    garbage = tmp_path / "notes.duckdb"
    garbage.write_text("not a database\n" * 100)
    done = _harness("serve", "--record-only", "--upstream", "http://127.0.0.1:9/v1", "--db", str(garbage),
                    "--port", "0", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    line = _error_line(done)
    assert str(garbage) in line and "--db" in line, line
    assert garbage.read_text() == "not a database\n" * 100


def test_serve_with_a_model_refuses_another_app_s_database_before_any_engine_starts(tmp_path, tiny_model_dir):
    """Another application's DuckDB file (tables, no harness schema) is refused before vLLM starts, and left as
    it was."""
    import duckdb

    foreign = tmp_path / "app.duckdb"
    with duckdb.connect(str(foreign)) as con:
        con.execute("CREATE TABLE invoices (id INTEGER, total DOUBLE)")
    before = foreign.read_bytes()
    run_dir = tmp_path / "run"
    done = _harness("serve", "--model", str(tiny_model_dir), "--db", str(foreign), "--port", "0",
                    "--run-dir", str(run_dir))
    assert done.returncode == 2, done.stderr
    line = _error_line(done)
    assert str(foreign) in line and "invoices" in line and "not a harness database" in line, line
    assert not (run_dir / "engine.log").exists() and "starting vLLM" not in done.stderr
    assert foreign.read_bytes() == before


@pytest.mark.parametrize("verb", ["serve", "view"])
@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_refused_naming_it(verb, port, tmp_path):
    run_dir = tmp_path / "run"
    given = ["--upstream", "http://127.0.0.1:9/v1", "--run-dir", str(run_dir)] if verb == "serve" else []
    done = _harness(verb, *given, f"--port={port}")
    assert done.returncode == 2
    line = _error_line(done)
    assert f"--port: {port} is not a port number" in line or f"--port: '{port}' is not" in line, line
    assert "give 1-65535, or 0 for a free one" in line, line
    assert not run_dir.exists()


def test_view_refuses_a_taken_port(harness_db, taken_port):
    done = _harness("view", "--db", str(harness_db), "--port", str(taken_port))
    assert done.returncode == 2
    line = _error_line(done)
    assert line.startswith(f"error: port {taken_port} on 127.0.0.1 is in use") and "--port N" in line, line


def test_view_refuses_a_file_that_is_not_a_database(tmp_path):
    garbage = tmp_path / "notes.duckdb"
    garbage.write_text("not a database\n" * 100)
    done = _harness("view", "--db", str(garbage), "--port", "0")
    assert done.returncode == 2
    line = _error_line(done)
    assert "notes.duckdb" in line and "not a DuckDB database file" in line and "harness database" in line, line


def test_view_refuses_a_file_that_does_not_exist(tmp_path):
    done = _harness("view", "--db", str(tmp_path / "nowhere.duckdb"), "--port", "0")
    assert done.returncode == 2
    line = _error_line(done)
    assert "nowhere.duckdb" in line and "--db" in line, line


def test_view_beyond_loopback_needs_a_token_as_serve_does(harness_db):
    done = _harness("view", "--db", str(harness_db), "--host", "0.0.0.0", "--port", "0",
                    env={"HARNESS_AUTH_TOKEN": ""})
    assert done.returncode == 2
    line = _error_line(done)
    assert "'0.0.0.0'" in line and "--auth-token" in line and "127.0.0.1" in line, line


def test_view_with_a_token_answers_only_requests_that_carry_it(harness_db):
    view = subprocess.Popen([sys.executable, "-m", "harness.cli", "view", "--db", str(harness_db), "--host",
                             "0.0.0.0", "--port", "0", "--auth-token", "s3cret"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = view.stdout.readline()
        assert ready.startswith("harness view: http://0.0.0.0:"), (ready, view.stderr.read() if not ready else "")
        port = int(ready.split("http://0.0.0.0:", 1)[1].split("/", 1)[0])
        base = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/api/runs", timeout=60)
        assert refused.value.code == 401
        with urllib.request.urlopen(f"{base}/?token=s3cret", timeout=60) as page:
            cookie = page.headers["Set-Cookie"].split(";", 1)[0]
        assert cookie == "harness_view_token=s3cret"
        asked = urllib.request.Request(f"{base}/api/runs", headers={"Cookie": cookie})
        with urllib.request.urlopen(asked, timeout=60) as runs:
            assert runs.status == 200
        bearer = urllib.request.Request(f"{base}/api/runs", headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(bearer, timeout=60) as runs:
            assert runs.status == 200
    finally:
        view.terminate()
        view.wait(timeout=600)


@pytest.mark.parametrize("verb", ["tiny-model", "smollm2"])
def test_model_builders_refuse_an_existing_file_before_building(verb, tmp_path):
    out = tmp_path / "model"
    out.write_text("mine\n")
    done = _harness(verb, str(out))
    assert done.returncode == 2
    line = _error_line(done)
    assert line.startswith(f"error: {str(out)!r} is a file") and "folder" in line, line
    assert out.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [out]  # no .smollm2.building-* folder


@pytest.mark.parametrize("verb", ["tiny-model", "smollm2"])
def test_model_builders_refuse_a_path_under_a_file(verb, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("mine\n")
    out = blocker / "model"
    done = _harness(verb, str(out))
    assert done.returncode == 2
    line = _error_line(done)
    assert line == (f"error: {str(out)!r} cannot be made: {str(blocker)!r} is a file; give a path in a folder you "
                    "can write"), line
    assert sorted(tmp_path.iterdir()) == [blocker]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_tiny_model_refuses_a_folder_nothing_can_be_made_in():
    done = _harness("tiny-model", "/proc/harness-model")
    assert done.returncode == 2
    line = _error_line(done)
    assert "'/proc/harness-model' cannot be made" in line and "folder you can write" in line, line
