#!/usr/bin/env python3
"""ptx_same.py: does a change leave the CUDA kernels' code as it was? Needs no GPU.

Compiles each named .cu file to PTX twice, as the build compiles it (its nvcc command from
the build directory's Ninja file, with PTX for one virtual architecture in place of the
object): once from the working tree, once from a clean copy of git revision REV (default
HEAD). Then compares every kernel (.entry) instruction by instruction, with registers and
labels renamed, and prints the kernels that differ with their first differing lines.

With --from OLD.cu (repeatable), the old side is those files at REV and the new side the
named files of the working tree, each side's kernels taken together: for a file split into
several (kernels moved between files and their helper types between namespaces), every
kernel must still exist once and be identical. Kernels are matched by their demangled
names with every namespace qualifier dropped, and the symbols inside their bodies are
compared the same way.

For refactors that must not change what runs (a helper shared between kernels, a lab
version's code reorganised): "identical" means the same PTX instructions in the same order,
so the same bits from every kernel; ptxas may still schedule them differently only if its
input differs, which it does not. A kernel that differs is not wrong, but its parity tests
must run on a GPU before the change is called safe.

  tools/ptx_same.py [--rev REV] [--build DIR] [--arch compute_90] [--from OLD.cu ...] FILE.cu ...
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
    differ between the two trees even where the code is the same. (For the symbols that
    c++filt cannot demangle.)"""
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


SYMBOL = re.compile(r"_Z[A-Za-z0-9_$]+")
PARAM = re.compile(r"(_param_\d+)$")


def symbol_names(symbols):
    """Each mangled symbol's comparable name: demangled by c++filt, with every namespace
    qualifier ("mhar::cuda::", "(anonymous namespace)::") dropped, so that a kernel or a
    helper type moved between files or namespaces keeps its name; a kernel parameter's
    suffix (_param_N) kept. Symbols c++filt leaves alone keep anonymous()'s form."""
    symbols = sorted(symbols)
    bases = [PARAM.sub("", s) for s in symbols]
    try:
        out = subprocess.run(["c++filt"], input="\n".join(bases) + "\n", check=True,
                             capture_output=True, text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        die(f"c++filt (binutils) is needed to compare symbols: {e}")
    names = {}
    for sym, base, dem in zip(symbols, bases, out):
        if dem == base:
            dem = anonymous(base)
        else:
            dem = dem.replace("(anonymous namespace)::", "")
            dem = re.sub(r"\b[A-Za-z_]\w*::", "", dem)
        m = PARAM.search(sym)
        names[sym] = dem + (m.group(1) if m else "")
    return names


def kernel_bodies(paths):
    """Each kernel's instructions over the PTX files `paths`, keyed by its comparable name
    (symbol_names), with the symbols inside the bodies renamed the same way, and registers
    and labels (and local-memory frames) renamed. A kernel found twice is an error (two
    files would define it)."""
    raw, current = {}, None
    for path in paths:
        with open(path) as f:
            for line in f:
                m = re.match(r"\s*(\.visible\s+|\.weak\s+)?\.entry\s+([^\s(]+)", line)
                if m:
                    current = m.group(2)
                    if current in raw:
                        die(f"kernel {current} found twice in {paths}")
                    raw[current] = []
                    continue
                t = line.strip()
                if current and t.endswith(";") and not t.startswith((".", "//")):
                    t = re.sub(r"\$L__\w+", "L", t)
                    # A kernel's local-memory frame is numbered file-wide: a kernel added
                    # earlier in the file renumbers the later ones' frames.
                    t = re.sub(r"__local_depot\d+", "__local_depot", t)
                    raw[current].append(re.sub(r"%[a-z]+\d+", "R", t))
    symbols = set(raw)
    for body in raw.values():
        for t in body:
            symbols.update(SYMBOL.findall(t))
    names = symbol_names(symbols)
    bodies = {}
    for k, body in raw.items():
        key = names[k]
        if key in bodies:
            die(f"two kernels share the name {key} once namespaces are dropped")
        bodies[key] = [SYMBOL.sub(lambda m: names[m.group(0)], t) for t in body]
    return bodies


def compile_ptx(cmd_args, arch, root, rel, source, build, out):
    """PTX of `rel` as found under `root`, compiled with the build's command for `source`."""
    cmd = ptx_command(cmd_args, arch, out)
    # The old tree's sources and includes: -I ROOT and the source itself move.
    cmd = [c.replace(f"-I{ROOT}", f"-I{root}") if c.startswith("-I") else c for c in cmd]
    cmd = [os.path.join(root, rel) if c == source else c for c in cmd]
    run = subprocess.run(cmd, cwd=build, capture_output=True, text=True)
    if run.returncode != 0:
        die(f"nvcc failed on {os.path.join(root, rel)}:\n{run.stderr[-2000:]}")


def report(label, old, new, rev):
    """Prints the comparison of two kernel sets; True where any kernel differs."""
    names = sorted(set(old) | set(new))
    changed = [k for k in names if old.get(k) != new.get(k)]
    print(f"{label}: {len(names) - len(changed)} of {len(names)} kernels identical to {rev}")
    for n, k in enumerate(changed):
        if n == 12:
            print(f"  ... and {len(changed) - n} more")
            break
        state = ("only at " + rev if k not in new else "new" if k not in old else
                 f"{len(old[k])} -> {len(new[k])} instructions")
        print(f"  differs: {k[:160]} ({state})")
        diff = [l for l in difflib.unified_diff(old.get(k, []), new.get(k, []), lineterm="", n=0)
                if l[:1] in "+-" and l[:3] not in ("---", "+++")]
        for l in diff[:8]:
            print(f"    {l}")
    return bool(changed)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE.cu")
    p.add_argument("--rev", default="HEAD", help="the revision to compare with (default HEAD)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"),
                   help="the configured build directory (default build/)")
    p.add_argument("--arch", default="compute_90", help="virtual architecture (default compute_90)")
    p.add_argument("--from", dest="old_files", action="append", default=[], metavar="OLD.cu",
                   help="compare the named files, together, with these files at REV, together")
    a = p.parse_args()
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        old_root = os.path.join(tmp, "old")
        os.mkdir(old_root)
        archive = subprocess.run(["git", "-C", ROOT, "archive", a.rev], capture_output=True)
        if archive.returncode != 0:
            die(f"git archive {a.rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", old_root], input=archive.stdout, check=True)

        def ptx(root, f, tag):
            """PTX of file f (a path as given) under root, by the build's command for f, or
            for the first named file where f is not (or no longer) in the build."""
            source = os.path.abspath(f)
            rel = os.path.relpath(source, ROOT)
            if not os.path.exists(os.path.join(root, rel)):
                die(f"{rel} does not exist {'at ' + a.rev if root == old_root else 'here'}")
            try_source = source if root == ROOT or os.path.exists(source) else \
                os.path.abspath(a.files[0])
            args = compile_command(a.build, try_source)
            out = os.path.join(tmp, f"{tag}_{os.path.basename(rel)}.ptx")
            compile_ptx(args, a.arch, root, rel, try_source, a.build, out)
            return out

        if a.old_files:
            old = kernel_bodies([ptx(old_root, f, "old") for f in a.old_files])
            new = kernel_bodies([ptx(ROOT, f, "new") for f in a.files])
            differ = report(" + ".join(a.files) + " (from " + " + ".join(a.old_files) + ")",
                            old, new, a.rev)
        else:
            for f in a.files:
                rel = os.path.relpath(os.path.abspath(f), ROOT)
                old = kernel_bodies([ptx(old_root, f, "old")])
                new = kernel_bodies([ptx(ROOT, f, "new")])
                differ = report(rel, old, new, a.rev) or differ
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
