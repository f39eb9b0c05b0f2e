#!/usr/bin/env python3
"""ptx_same.py: does a change leave the CUDA kernels' code as it was? Needs no GPU.

Compiles each named .cu file to PTX twice, as the build compiles it (its nvcc command from
the build directory's Ninja file, with PTX for one virtual architecture in place of the
object): once from the working tree, once from a clean copy of git revision REV (default
HEAD). Then compares every kernel (.entry) instruction by instruction, with registers and
labels renamed, and prints the kernels that differ with their first differing lines.

For refactors that must not change what runs (a helper shared between kernels, a lab
version's code reorganised): "identical" means the same PTX instructions in the same order,
so the same bits from every kernel; ptxas may still schedule them differently only if its
input differs, which it does not. A kernel that differs is not wrong, but its parity tests
must run on a GPU before the change is called safe.

  tools/ptx_same.py [--rev REV] [--build DIR] [--arch compute_90] FILE.cu ...
Exit status: 0 when every kernel of every file is identical, 1 when any differs, 2 on
errors (no build directory, a file the build does not compile, nvcc failing).
"""
import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die(msg):
    print(f"ptx_same.py: {msg}", file=sys.stderr)
    sys.exit(2)


def compile_command(build, source):
    """The build's nvcc command for `source` (an absolute path), as an argument list."""
    try:
        out = subprocess.run(["ninja", "-C", build, "-t", "commands"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        die(f"cannot list the build's commands in {build} ({e}); configure it first "
            "(README, 'Build')")
    for line in out.splitlines():
        args = shlex.split(line)
        if "-c" in args and args[args.index("-c") + 1] == source:
            return args
    die(f"the build in {build} does not compile {source} (only .cu files of the CUDA "
        "build can be compared)")


def ptx_command(args, arch, out):
    """args turned into a PTX compile for one virtual architecture into `out`."""
    cmd, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in ("-MD", "-lineinfo") or a.startswith("--generate-code"):
            continue
        if a in ("-MT", "-MF", "-o"):
            skip = 1
            continue
        if a == "-c":
            cmd.append("-ptx")
            continue
        cmd.append(a)
    # sm_90a objects (wgmma) want the architecture-specific virtual target.
    wants_a = any("compute_90a" in a for a in args)
    cmd += [f"-arch={arch}a" if wants_a and not arch.endswith("a") else f"-arch={arch}",
            "-o", out]
    return cmd


def anonymous(line):
    """The line with each anonymous namespace's and internal static's mangled identifier
    (length-prefixed: "43_GLOBAL__N__<path hash>_<file>_<content hash>", "41_INTERNAL_...")
    replaced by a fixed one: nvcc derives them from the file's path and contents, which
    differ between the two trees even where the code is the same."""
    out, i = [], 0
    for m in re.finditer(r"(\d+)(_GLOBAL__N__|_INTERNAL_)", line):
        if m.start() < i:
            continue
        n = int(m.group(1))
        out.append(line[i:m.start()])
        out.append("ANON")
        i = m.start() + len(m.group(1)) + n
    out.append(line[i:])
    return "".join(out)


def kernel_bodies(path):
    """Each kernel's instructions; the tags nvcc derives from the file's path (which
    differs between the two trees: anonymous namespaces, internal statics), registers and
    labels renamed."""
    bodies, current = {}, None
    with open(path) as f:
        for line in f:
            line = anonymous(line)
            m = re.match(r"\s*(\.visible\s+|\.weak\s+)?\.entry\s+([^\s(]+)", line)
            if m:
                current = m.group(2)
                bodies[current] = []
                continue
            t = line.strip()
            if current and t.endswith(";") and not t.startswith((".", "//")):
                t = re.sub(r"\$L__\w+", "L", t)
                bodies[current].append(re.sub(r"%[a-z]+\d+", "R", t))
    return bodies


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE.cu")
    p.add_argument("--rev", default="HEAD", help="the revision to compare with (default HEAD)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"),
                   help="the configured build directory (default build/)")
    p.add_argument("--arch", default="compute_90", help="virtual architecture (default compute_90)")
    a = p.parse_args()
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        old_root = os.path.join(tmp, "old")
        os.mkdir(old_root)
        archive = subprocess.run(["git", "-C", ROOT, "archive", a.rev], capture_output=True)
        if archive.returncode != 0:
            die(f"git archive {a.rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", old_root], input=archive.stdout, check=True)
        for f in a.files:
            source = os.path.abspath(f)
            rel = os.path.relpath(source, ROOT)
            if not os.path.exists(os.path.join(old_root, rel)):
                die(f"{rel} does not exist at {a.rev}")
            args = compile_command(a.build, source)
            results = {}
            for side, root in (("old", old_root), ("new", ROOT)):
                out = os.path.join(tmp, f"{side}_{os.path.basename(rel)}.ptx")
                cmd = ptx_command(args, a.arch, out)
                # The old tree's sources and includes: -I ROOT and the source itself move.
                cmd = [c.replace(f"-I{ROOT}", f"-I{root}") if c.startswith("-I") else c
                       for c in cmd]
                cmd = [os.path.join(root, rel) if c == source else c for c in cmd]
                run = subprocess.run(cmd, cwd=a.build, capture_output=True, text=True)
                if run.returncode != 0:
                    die(f"nvcc failed on the {side} {rel}:\n{run.stderr[-2000:]}")
                results[side] = kernel_bodies(out)
            old, new = results["old"], results["new"]
            names = sorted(set(old) | set(new))
            changed = [k for k in names if old.get(k) != new.get(k)]
            print(f"{rel}: {len(names) - len(changed)} of {len(names)} kernels identical "
                  f"to {a.rev}")
            for n, k in enumerate(changed):
                differ = True
                if n == 12:
                    print(f"  ... and {len(changed) - n} more")
                    break
                print(f"  differs: {k[:160]} ({len(old.get(k, []))} -> "
                      f"{len(new.get(k, []))} instructions)")
                diff = [l for l in difflib.unified_diff(old.get(k, []), new.get(k, []),
                                                        lineterm="", n=0)
                        if l[:1] in "+-" and l[:3] not in ("---", "+++")]
                for l in diff[:8]:
                    print(f"    {l}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
