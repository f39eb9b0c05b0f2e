#!/usr/bin/env python3
"""test_make_table.py: make_table.py on synthetic run folders whose right answers are known
(seed means and half ranges, median throughput, the paper-ordering verdicts, unfinished runs,
an archive that supersedes a folder, the SVG plots), and, given the `mhar` binary as the first
argument, every config of configs/replicate/ through `mhar config`. Run by ctest
(CMakeLists.txt: replicate_make_table) or by hand: python3 tools/replicate/test_make_table.py [MHAR]
"""
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import unittest
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import make_table  # noqa: E402

MHAR = None


def write_run(root, name, val_losses, final, tps, done=True, tasks=True, probe=None, steps=100, seconds=42):
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"train": {"steps": steps, "lr": 0.002}}, f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for i, t in enumerate(tps):
            f.write(json.dumps({"kind": "train", "step": (i + 1) * 10, "tokens_per_s": t, "loss": 5.0}) + "\n")
        for step, v in val_losses:
            f.write(json.dumps({"kind": "eval", "step": step, "val_loss": v}) + "\n")
        f.write('{"kind":"train","step":\n')  # a line cut by a killed writer
    with open(os.path.join(d, "timing.jsonl"), "w") as f:
        f.write(json.dumps({"phase": "train", "seconds": seconds}) + "\n")
        f.write(json.dumps({"phase": "eval", "seconds": 7}) + "\n")
    if done:
        open(os.path.join(d, "DONE"), "w").write("x\n")
        json.dump({"loss": final, "ppl": 2.718281828459045 ** final}, open(os.path.join(d, "eval_val.json"), "w"))
        if tasks:
            json.dump({"acc": 0.25, "perplexity": 100.0}, open(os.path.join(d, "eval_lambada.json"), "w"))
            json.dump({"acc": 0.3, "acc_norm": 0.35}, open(os.path.join(d, "eval_hellaswag.json"), "w"))
            json.dump({"word_perplexity": 50.0}, open(os.path.join(d, "eval_wikitext.json"), "w"))
    if probe:
        os.makedirs(os.path.join(d, "probe"), exist_ok=True)
        json.dump(probe, open(os.path.join(d, "probe", "probe.json"), "w"))
    return d


PROBE = {"sites": [{"name": "attention 0", "sources": 1, "mean_weights": [[1.0], [1.0]]},
                   {"name": "MLP 0", "sources": 2, "mean_weights": [[0.25, 0.75], [0.5, 0.5]]},
                   {"name": "attention 1", "sources": 3, "mean_weights": [[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]}]}


class MakeTableTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.runs = os.path.join(self.tmp.name, "runs")
        r = self.runs
        # small: standard 3.0 / 3.2 (mean 3.1, half range 0.1); mhar 2.90 / 2.94 (2.92, 0.02):
        # gap 0.18 > 0.12, resolved. attnres 3.05 / 3.13 (3.09, 0.04) vs standard: gap 0.01 < 0.14.
        write_run(r, "small_standard_s0", [(0, 10.8), (50, 4.0), (100, 3.0)], 3.0, [1, 2, 100, 200, 300])
        write_run(r, "small_standard_s1", [(0, 10.8), (100, 3.2)], 3.2, [1, 2, 300, 400, 500])
        write_run(r, "small_mhar_s0", [(0, 10.8), (100, 2.9)], 2.90, [9, 9, 150], probe=PROBE)
        write_run(r, "small_mhar_s1", [(0, 10.8), (100, 2.94)], 2.94, [9, 9, 250], probe=PROBE)
        write_run(r, "small_attnres_s0", [(0, 10.8), (100, 3.05)], 3.05, [100])
        write_run(r, "small_attnres_s1", [(0, 10.8), (100, 3.13)], 3.13, [100])
        # hyper: one finished seed, worse than standard; one unfinished seed (no loss counted).
        write_run(r, "small_hyper_s0", [(0, 10.8), (100, 3.3)], 3.3, [100], tasks=False)
        write_run(r, "small_hyper_s1", [(0, 10.8), (50, 3.9)], None, [100, 100, 100, 100, 100], done=False)
        # a sweep run is not a grid run
        write_run(os.path.join(r, "sweep"), "small_standard_s0", [(100, 1.0)], 1.0, [1])
        open(os.path.join(r, "sweep_small.txt"), "w").write("0.001 3.5000\n0.002 3.4000\n")
        self.out = os.path.join(self.tmp.name, "report")

    def tearDown(self):
        self.tmp.cleanup()

    def run_tool(self, *paths):
        self.assertEqual(make_table.main(["--out", self.out, *paths]), 0)
        with open(os.path.join(self.out, "table.md")) as f:
            return f.read()

    def row(self, md, size, label):
        rows = [l for l in md.splitlines() if l.startswith(f"| {size} | {label} |")]
        self.assertEqual(len(rows), 1, md)
        return [c.strip() for c in rows[0].strip("|").split("|")]

    def test_numbers(self):
        md = self.run_tool(self.runs)
        std = self.row(md, "small", "standard")
        self.assertEqual(std[2], "3.100 ± 0.100 (n=2)")
        # tokens/s: median of each run's logged steps after the first two (200 and 400), then
        # the seed mean 300 ± 100.
        self.assertEqual(std[8], "300 ± 100 (n=2)")
        self.assertEqual(std[9], "42 ± 0 (n=2)")
        self.assertEqual(std[4], "0.250 ± 0.000 (n=2)")
        self.assertEqual(std[6], "0.350 ± 0.000 (n=2)")
        self.assertEqual(std[7], "50.0 ± 0.0 (n=2)")
        self.assertEqual(std[3], f"{(2.718281828459045 ** 3.0 + 2.718281828459045 ** 3.2) / 2:.2f} ± "
                                 f"{(2.718281828459045 ** 3.2 - 2.718281828459045 ** 3.0) / 2:.2f} (n=2)")
        mh = self.row(md, "small", "MHAR (H=KV)")
        self.assertEqual(mh[2], "2.920 ± 0.020 (n=2)")
        self.assertEqual(mh[8], "200 ± 50 (n=2)")
        hy = self.row(md, "small", "Hyper-Conn. (n=4)")
        self.assertEqual(hy[2], "3.300")  # only the finished seed
        self.assertEqual(hy[4], "-")  # no task files
        self.assertIn("s1 (step 50/100, unfinished)", hy[10])
        self.assertIn("not run", self.row(md, "large", "standard")[2])
        # The paper's numbers, as the issue gives them.
        self.assertIn("| 350M | 2.997 | 2.931 | 2.876 | 2.848 |", md)
        # Orderings: the verdict and whether the gap clears the seed spread.
        self.assertIn("- small: MHAR (H=KV) 2.920 vs standard 3.100 (gap +0.180): as in the paper; "
                      "the gap exceeds the seeds' half ranges summed (0.120)", md)
        self.assertIn("- small: AttnRes 3.090 vs standard 3.100 (gap +0.010): as in the paper; "
                      "within the seeds' half ranges summed (0.140): not resolved", md)
        self.assertIn("- small: Hyper-Conn. (n=4) 3.300 vs standard 3.100 (gap -0.200): NOT as in the paper; "
                      "one seed: no spread", md)
        self.assertIn("- small: lr 0.001: 3.5000, lr 0.002: 3.4000", md)

    def test_plots(self):
        self.run_tool(self.runs)
        curves = ET.parse(os.path.join(self.out, "val_loss_small.svg")).getroot()
        lines = [e for e in curves.iter() if e.get("class") == "curve"]
        # 8 grid runs with curves (the sweep run excluded).
        self.assertEqual(len(lines), 8)
        std0 = [e for e in lines if e.get("data-run") == "small_standard_s0"][0]
        self.assertEqual(len(std0.get("points").split()), 2)  # steps 50 and 100; step 0 left out
        self.assertFalse(os.path.exists(os.path.join(self.out, "val_loss_large.svg")))
        depth = ET.parse(os.path.join(self.out, "depth_small_mhar_s0.svg")).getroot()
        cells = [e for e in depth.iter() if e.get("class") == "cell"]
        self.assertEqual(len(cells), 2 * (1 + 2 + 3))
        # weight 0.75 -> 255 * 0.25 = 64 in the green and blue channels
        fills = {c.find("{http://www.w3.org/2000/svg}title").text: c.get("fill") for c in cells[:6]}
        self.assertEqual(fills["MLP 0 source 1: 0.750"], "rgb(255,64,64)")

    def test_archive_supersedes_folder(self):
        # A later call's archive holds small_hyper_s1 finished: it replaces the unfinished copy.
        later = os.path.join(self.tmp.name, "later")
        write_run(later, "small_hyper_s1", [(100, 3.5)], 3.5, [100])
        arch = os.path.join(self.tmp.name, "replicate_runs.tar.gz")
        with tarfile.open(arch, "w:gz") as tf:
            tf.add(later, arcname=".")
        md = self.run_tool(self.runs, arch)
        self.assertEqual(self.row(md, "small", "Hyper-Conn. (n=4)")[2], "3.400 ± 0.100 (n=2)")

    def test_archive_escape_refused(self):
        arch = os.path.join(self.tmp.name, "bad.tar.gz")
        src = os.path.join(self.tmp.name, "f")
        open(src, "w").write("x")
        with tarfile.open(arch, "w:gz") as tf:
            tf.add(src, arcname="../evil")
        with self.assertRaises(SystemExit) as cm:
            make_table.main(["--out", self.out, arch])
        self.assertIn("refusing archive member", str(cm.exception))

    def test_no_runs(self):
        empty = os.path.join(self.tmp.name, "empty")
        os.makedirs(empty)
        self.assertEqual(make_table.main(["--out", self.out, empty]), 1)


class ConfigsTest(unittest.TestCase):
    """Every grid config passes `mhar config`, and within a size only the residual differs."""

    def test_configs(self):
        cfg_dir = os.path.join(ROOT, "configs", "replicate")
        names = sorted(os.listdir(cfg_dir))
        self.assertEqual(len(names), 10)
        for size in ("small", "large"):
            base = json.load(open(os.path.join(cfg_dir, f"{size}_standard.json")))
            for mode in ("hyper", "attnres", "mhar", "block_mhar"):
                c = json.load(open(os.path.join(cfg_dir, f"{size}_{mode}.json")))
                for section in ("model", "train", "data", "checkpoint"):
                    self.assertEqual(c[section], base[section], f"{size}_{mode}: {section}")
            m = base["model"]
            # non-embedding parameters of the layers (norm and routing vectors are far below 1%)
            attn = m["d_model"] * m["head_dim"] * (2 * m["n_heads"] + 2 * m["n_kv_heads"])
            per_layer = attn + 3 * m["d_model"] * m["d_ff"]
            n = per_layer * m["n_layers"]
            self.assertTrue((18e6 <= n <= 22e6) if size == "small" else (80e6 <= n <= 90e6), n)
        if MHAR is None:
            self.skipTest("no mhar binary given")
        for name in names:
            p = subprocess.run([MHAR, "config", os.path.join(cfg_dir, name)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, f"{name}: {p.stderr}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        MHAR = sys.argv.pop(1)
    unittest.main()
