"""Embedded mode: with no daemon answering, the first client starts one for this user."""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code, env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def embedded_env(tmp_path, build_dir):
    env = dict(os.environ)
    env.pop("TRAINSTREAM_SOCKET", None)
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    env["TRAINSTREAM_DAEMON"] = str(build_dir / "bin" / "trainstreamd")
    env["TRAINSTREAM_IDLE_EXIT_S"] = "60"
    env["PYTHONPATH"] = os.pathsep.join([str(build_dir / "python"), os.path.join(REPO, "tests", "python")])
    yield env
    sock = tmp_path / "trainstream" / "trainstreamd.sock"
    if sock.exists():
        subprocess.run([str(build_dir / "bin" / "trainstreamctl"), "--socket", str(sock), "shutdown",
                        "--discard-state"],
                       capture_output=True, timeout=30)


def test_first_client_starts_a_daemon_and_the_next_reuses_it(embedded_env, tmp_path):
    code = """
        import torch, trainstream
        from trainstream._native import daemon as _daemon
        from tiny_gpt import GPTConfig, TinyGPT
        model, opt = trainstream.wrap(TinyGPT(GPTConfig()))
        print(_daemon.connect().ping()["pid"])
    """
    first = _run(code, embedded_env)
    assert first.returncode == 0, first.stderr
    sock = tmp_path / "trainstream" / "trainstreamd.sock"
    assert sock.exists(), "the embedded daemon listens on $XDG_RUNTIME_DIR/trainstream/"
    second = _run(code, embedded_env)
    assert second.returncode == 0, second.stderr
    assert first.stdout.split()[-1] == second.stdout.split()[-1], "the second client reuses the daemon"


def test_explicit_socket_that_does_not_answer_is_an_error(embedded_env, tmp_path):
    env = dict(embedded_env, TRAINSTREAM_SOCKET=str(tmp_path / "nobody.sock"))
    r = _run("""
        import trainstream
        from tiny_gpt import GPTConfig, TinyGPT
        try:
            trainstream.wrap(TinyGPT(GPTConfig()))
        except trainstream.DaemonError as e:
            print("DaemonError:", e)
    """, env)
    assert "DaemonError: no TrainStream daemon answers at" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "trainstream").exists(), "no daemon is started for an explicit socket"
