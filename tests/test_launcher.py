"""What the launcher gives the process it starts, read by a script that prints it; its help."""

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


def test_the_launchers_print_their_own_help_and_pass_a_scripts_help_to_one_process():
    """./launch.sh --help (or -h) prints its header and exits 0, as no argument does on stderr with exit 2; a
    script's --help goes to the script, on one process where torchrun would start two; ./train_mmdit_stable.sh
    --help prints its header, then the script's help (`echo` stands for the interpreter)."""
    env = {**os.environ, "PYTHON": "echo", "NPROC_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": ""}
    run = lambda *argv: subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    header = "Launcher of this project's entry points: ./launch.sh SCRIPT.py [arguments]\n"
    for flag in ("--help", "-h"):
        done = run("./launch.sh", flag)
        assert done.returncode == 0 and done.stdout.startswith(header) and "  NPROC_PER_NODE  " in done.stdout
    done = run("./launch.sh")
    assert done.returncode == 2 and done.stderr.startswith(header)
    assert run("./launch.sh", "precompute_latents.py", "--help").stdout == "precompute_latents.py --help\n"
    done = run("./train_mmdit_stable.sh", "--help")
    assert done.stdout.startswith("Launcher: ./train_mmdit_stable.sh [--config FILE] [key=value ...]\n")
    assert done.stdout.endswith(f"\n\n{ROOT / 'train_mmdit_stable.py'} --help\n"), done.stdout
