"""What the launcher gives the process it starts, read by a script that prints it."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def launched_env(tmp_path, **env) -> str:
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(os.environ.get('GOMP_SPINCOUNT'))\n")
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    return subprocess.run([str(ROOT / "launch.sh"), str(script)], env={**base, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, check=True).stdout.strip()


def test_cpu_threads_spin_briefly_unless_the_user_chose(tmp_path):
    """benchmarks/threads.py: a short OpenMP spin loses least on an idle and on a busy machine alike."""
    assert launched_env(tmp_path) == "1000"
    assert launched_env(tmp_path, GOMP_SPINCOUNT="300000") == "300000"
