"""tests/warm.py runs a script as ``python`` would: the same exit codes, output, ``atexit`` order,
environment, arguments and working directory, compared with a real ``python`` where it matters.

    python -m pytest -q tests/test_warm.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests import warm

SCRIPT = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("at exit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
print(sys.argv[1:], os.environ.get("WARM_SAID"), os.path.basename(os.getcwd()), __name__)
what = sys.argv[1]
if what == "raise":
    raise RuntimeError("boom")
if what == "exit":
    sys.exit(3)
if what == "stop":
    print("waiting", flush=True)
    time.sleep(60)
"""


def test_a_warm_script_ends_as_under_python(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    (tmp_path / "here").mkdir()
    env = {**os.environ, "WARM_SAID": "hi"}
    for what, code in (("ok", 0), ("exit", 3), ("raise", 1)):
        got = warm.run(script, [what], env, cwd=tmp_path / "here", timeout=60)
        assert got[0] == code and got[1] == f"['{what}'] hi here __main__\nthread joined\nat exit\n", (what, got)
    real = subprocess.run(
        [sys.executable, str(script), "raise"], env=env, cwd=tmp_path / "here", capture_output=True, text=True
    )
    assert (real.returncode, real.stdout) == got[:2]
    assert real.stderr.splitlines()[-1] == got[2].splitlines()[-1] == "RuntimeError: boom"


def test_a_warm_script_dies_of_a_signal_as_a_process(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    p = warm.Script(script, ["stop"], dict(os.environ), out, tmp_path / "err")
    deadline = time.monotonic() + 60
    while "waiting" not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None
    p.kill()
    assert p.wait(30) == -signal.SIGKILL and p.returncode == -signal.SIGKILL
