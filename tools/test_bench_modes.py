#!/usr/bin/env python3
"""test_bench_modes.py: tools/bench_modes.sh on stand-ins for `mhar bench` and nvidia-smi whose
right answers are known: each mode's tokens/s and joules a step against the first mode's, the
rounds' ratios, a run that fails, a mode without a config, and with POWER=1 the medians of the
power and clock samples over the timed steps only (the stand-in GPU draws other watts before
and after them).
Run by ctest (CMakeLists.txt: bench_modes_script) or by hand: python3 tools/test_bench_modes.py
"""
import json
import os
import shutil
import stat
import subprocess
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "bench_modes.sh")

# The stand-in `mhar`: `mhar --log-level warn bench CONFIG --steps N --warmup W`. It names the
# GPU's phase in $FAKE_PHASE (watts and MHz, read by the stand-in nvidia-smi): set-up, then
# the timed steps (steps x ms_per_step), then 0.3 s of teardown, bench_modes.sh's allowance.
FAKE_MHAR = r'''#!/usr/bin/env python3
import json, os, sys, time
cfg, steps = sys.argv[4], int(sys.argv[sys.argv.index("--steps") + 1])
mode = os.path.basename(cfg).split("_", 1)[1].removesuffix(".json")
if mode == os.environ.get("FAKE_FAIL"):
    print("bench: out of memory", file=sys.stderr)
    sys.exit(1)
ms = 80.0
def phase(watts, mhz):
    with open(os.environ["FAKE_PHASE"] + ".tmp", "w") as f:
        f.write(f"{watts} {mhz}\n")
    os.replace(os.environ["FAKE_PHASE"] + ".tmp", os.environ["FAKE_PHASE"])
phase(100, 1500); time.sleep(1.0)  # longer than the steps: without the window, 100 W wins
phase(600, 1700); time.sleep(steps * ms / 1e3)
phase(300, 1600); time.sleep(0.3)
tps = {"standard": 1000.0, "mhar": 900.0}[mode]
print(json.dumps({"config": cfg, "tokens_per_s": tps, "ms_per_step": ms, "steps_timed": steps,
                  "peak_mem_bytes": {"standard": 2**30, "mhar": 2**30 + 2**28}[mode],
                  "mfu": tps / 1e4, "energy_j_per_step": {"standard": 50.0, "mhar": 60.0}[mode],
                  "power_w": 625.0, "power_limit_w": 700.0}))
'''

# The stand-in nvidia-smi: a sample every 0.1 s in --format=csv,noheader,nounits of
# timestamp,power.draw,clocks.sm, the timestamp in nvidia-smi's own format.
FAKE_SMI = r'''#!/usr/bin/env python3
import datetime, os, sys, time
while True:
    try:
        watts, mhz = open(os.environ["FAKE_PHASE"]).read().split()
    except (OSError, ValueError):
        watts, mhz = "[N/A]", "[N/A]"
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{now}, {watts}, {mhz}", flush=True)
    time.sleep(0.1)
'''


class BenchModesTest(unittest.TestCase):
    def run_script(self, modes, **env):
        tmp = tempfile.mkdtemp(prefix="bench_modes_test_")
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        bin_dir = os.path.join(tmp, "bin")
        os.makedirs(bin_dir)
        for name, text in (("mhar", FAKE_MHAR), ("nvidia-smi", FAKE_SMI)):
            path = os.path.join(bin_dir, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
        out = os.path.join(tmp, "out")
        full_env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"],
                        MHAR=os.path.join(bin_dir, "mhar"), OUT=out,
                        FAKE_PHASE=os.path.join(tmp, "phase"), STEPS="10", WARMUP="1")
        full_env.update(env)
        r = subprocess.run(["bash", SCRIPT, "100m", *modes], env=full_env, capture_output=True,
                           text=True, timeout=120)
        lines = {l.split()[1].rstrip(":"): l for l in r.stdout.splitlines() if l.startswith("BENCH_MODES")}
        return r, lines, out

    def test_ratios_against_the_first_mode_per_round(self):
        r, lines, out = self.run_script(["standard", "mhar"], ROUNDS="2")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("1000 tok/s (1.000x the first)", lines["100m_standard"])
        mhar = lines["100m_mhar"]
        self.assertIn("900 tok/s (0.900x the first)", mhar)
        self.assertIn("peak 1.25 GiB (1.250x)", mhar)
        self.assertIn("median of 2 rounds, the rounds' ratios 0.900 0.900", mhar)
        self.assertIn("60.0 J/step (1.200x), 625 W of 700", mhar)
        self.assertNotIn("SM MHz", mhar)  # POWER unset: no sampler
        with open(os.path.join(out, "bench.jsonl")) as f:
            rounds = [json.loads(l)["bench_round"] for l in f]
        self.assertEqual(rounds, [1, 1, 2, 2])

    def test_power_medians_cover_the_timed_steps_only(self):
        r, lines, out = self.run_script(["standard", "mhar"], POWER="1")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for mode in ("100m_standard", "100m_mhar"):
            tail = lines[mode].split("per run: ")[1]
            watts_mhz, samples = tail.rstrip(")").split("(")
            # The steps last 0.8 s at a sample every 0.1 s; set-up (100 W) and teardown (300 W)
            # outside the window would pull the median off 600 W.
            self.assertEqual(watts_mhz, "600/1700", lines[mode])
            self.assertGreaterEqual(int(samples), 4, lines[mode])
        self.assertTrue(os.path.exists(os.path.join(out, "power_1_mhar.csv")))

    def test_a_failed_run_and_a_missing_config_fail_the_script(self):
        r, lines, _ = self.run_script(["standard", "mhar", "nosuchmode"], FAKE_FAIL="mhar")
        self.assertEqual(r.returncode, 1)
        self.assertIn("BENCH_MODES 100m mhar (round 1) FAILED", r.stdout)
        self.assertIn("BENCH_MODES 100m nosuchmode: no configs/100m_nosuchmode.json", r.stdout)
        self.assertIn("1.000x the first", lines["100m_standard"])

    def test_power_without_nvidia_smi_is_refused(self):
        tmp = tempfile.mkdtemp(prefix="bench_modes_test_")
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        # A PATH of just what the script runs before it would sample, without nvidia-smi.
        bin_dir = os.path.join(tmp, "bin")
        os.makedirs(bin_dir)
        for tool in ("bash", "dirname", "mkdir"):
            os.symlink(shutil.which(tool), os.path.join(bin_dir, tool))
        env = dict(os.environ, PATH=bin_dir, POWER="1", OUT=os.path.join(tmp, "out"))
        r = subprocess.run([shutil.which("bash"), SCRIPT, "100m", "standard"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("POWER=1 samples with nvidia-smi, which is not on PATH", r.stderr)

if __name__ == "__main__":
    unittest.main()
