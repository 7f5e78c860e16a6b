"""Training speed of the default run by CPU thread setting, on an idle machine and on one another job keeps busy.

    python benchmarks/threads.py [--rounds 3 --steps 40 --out benchmarks/threads.json]

Each run is the default recipe (shapes) for `--steps` steps; its speed is the images/s the training log reports
after the first log interval (start-up and the first steps' warm-up left out).
"Busy" starts one spinning process per core beside it, as another user's job on a shared machine does. Settings
and conditions alternate within each round, so the machine's drift hits all alike; the table gives medians over
the rounds and each setting's speed as a fraction of the best setting under the same condition.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> the OpenMP environment training starts with (the entry point is run directly: the launcher would add its
# default, GOMP_SPINCOUNT=1000, to the first)
SETTINGS = {
    "OMP_NUM_THREADS unset (torch: one per core)": {},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "GOMP_SPINCOUNT=100": {"GOMP_SPINCOUNT": "100"},
}
CONDITIONS = ("idle", "busy")


def images_per_second(settings_env: dict, steps: int) -> float:
    """Median images/s over the log lines after the first of one short training run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(settings_env)
    with tempfile.TemporaryDirectory() as run_dir:
        log = subprocess.run(
            [sys.executable, str(ROOT / "train_mmdit_stable.py"), f"training.max_steps={steps}", f"logging.log_every={steps // 4}",
             "validation.at_end=false", f"checkpoint.every={steps * 10}", f"logging.output_dir={run_dir}/run"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True, cwd=ROOT).stdout
    rates = [float(r) for r in re.findall(r" ([\d.]+) img/s", log)]
    return statistics.median(rates[1:])


def spinners(count: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "threads.json"))
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    rates = {(c, s): [] for c in CONDITIONS for s in SETTINGS}
    for round_ in range(args.rounds):
        for condition in CONDITIONS:
            load = spinners(cores) if condition == "busy" else []
            try:
                for name, env in SETTINGS.items():
                    rates[condition, name].append(images_per_second(env, args.steps))
                    print(f"round {round_ + 1} {condition:4} {name}: {rates[condition, name][-1]:.1f} img/s",
                          file=sys.stderr)
            finally:
                for p in load:
                    p.kill()
                    p.wait()
    rows = []
    for condition in CONDITIONS:
        best = max(statistics.median(rates[condition, s]) for s in SETTINGS)
        for name in SETTINGS:
            median = statistics.median(rates[condition, name])
            rows.append({"condition": condition, "setting": name, "img_per_s": rates[condition, name],
                         "median_img_per_s": median, "of_best": median / best})
    print(f"{'machine':8} {'setting':44} {'img/s (median)':>15} {'of best':>8}")
    for row in rows:
        print(f"{row['condition']:8} {row['setting']:44} {row['median_img_per_s']:15.1f} {row['of_best']:8.2f}")
    Path(args.out).write_text(json.dumps({"cores": cores, "steps": args.steps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
