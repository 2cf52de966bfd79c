"""Benchmark blockfs at the scale it exists for: pack, mount, list and read millions of small files.

    python tools/bench/bench_scale.py [--files 1000000] [--dirs 1000] [--no-plain] [--sample 200000]
                                      [--fuse kernel|mfusepy] [--work DIR] [--json OUT] [--pack-only]

The dataset is ImageNet-shaped: ``--dirs`` class directories of files of 512–3,584 bytes, made up from a
seed by tools/bench/helpers/synthetic_source.py, so ten million files need no ten-million-file tree on
disk: the pack reads the synthetic source itself.  With a plain tree beside it (the default up to
2,000,000 files; ``--no-plain`` to skip) the same files are also written as plain files and every step is
measured on them too, and on tools/bench/helpers/null_fs.py serving that tree (a FUSE server that does no
work: the floor of the route, on the mount's route).  Measured in one run:

* pack: wall time and the peak resident memory of the pack process (its children included, from
  ``wait4``), packing the synthetic source (``--code DIR`` runs another checkout's blockfs, for a before
  and after);
* mount: the time ``blockfs mount`` takes to return, and the server's own memory (RssAnon) then;
* the listing: ``os.walk`` of the whole tree (what ImageFolder's constructor does), its time, the server's
  RssAnon and the kernel's slab (``/proc/meminfo`` Slab) after it;
* ``blockfs info``, ``verify``, ``ls`` of one directory and the loader's epoch order (``--unpack``: unpack
  too): time and peak memory of each;
* reads of a random ``--sample`` of the files by 4 threads from a list of paths: after the listing (page
  cache dropped, dentries kept), again (the kernel-served pass: page cache warm), and on a fresh mount with
  no listing first (every cache dropped), as a CSV-driven dataset does.

Cache drops need root; without it the "cold" figures are warm and the JSON says so.  The machine may be
shared: quote ratios from one run.  Writes the table to stdout and everything to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import HELPERS, ROOT
from helpers.benchutil import compiled, drop_caches, read_files_threads
from helpers.synthetic_source import SyntheticSource, write_tree

from blockfs.serve.daemon import serving_pid, unmount, wait_until_mounted

PLAIN_UP_TO = 2_000_000  # files: a plain tree is written beside the pack by default up to this many


# --- measuring ---------------------------------------------------------------------------------------
def slab_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_anon(pid: int | None) -> int | None:
    """The process's own memory (anonymous: not its mapped files, not the page cache), in bytes."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def timed_child(command: list[str], env: dict | None = None) -> dict:
    """Run ``command``; its wall time and peak resident memory (the largest of it and its children, as
    ``wait4`` reports it: /usr/bin/time -v's "Maximum resident set size")."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        # Started outside the checkout: `python -c`/`-m` put the working directory first on sys.path,
        # which would shadow PYTHONPATH's blockfs (--code).
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd="/")
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, not by Popen: wait4 gives its rusage
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode:
        raise SystemExit(f"{command[:4]} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024, "stdout": stdout}


def walk(root: Path) -> dict:
    """``os.walk`` of the whole tree, as ImageFolder does: time, entries, and the kernel slab it grew."""
    slab = slab_bytes()
    start = time.perf_counter()
    files = dirs = 0
    for _, ds, fs in os.walk(root):
        dirs += len(ds)
        files += len(fs)
    return {
        "seconds": time.perf_counter() - start,
        "files": files,
        "dirs": dirs,
        "slab_grew": slab_bytes() - slab,
        "slab": slab_bytes(),
    }


def read_sample(root: Path, names: list[str], threads: int = 4) -> dict:
    """Read every file of ``names`` (in that order, dealt to ``threads`` threads); files/s."""
    paths = [os.path.join(root, n) for n in names]
    seconds, nbytes = read_files_threads(paths, threads)
    return {"files_s": len(paths) / seconds, "seconds": seconds, "files": len(paths), "bytes": nbytes}


# --- the systems -------------------------------------------------------------------------------------
class Mount:
    """A mount of one of the systems, started the way a user starts it, timed until it serves."""

    def __init__(self, kind: str, what: Path, mnt: Path, route: str, env: dict) -> None:
        self.kind, self.what, self.mnt, self.route, self.env = kind, what, mnt, route, env
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    def start(self) -> float:
        self.mnt.mkdir(parents=True, exist_ok=True)
        log = str(self.mnt) + ".log"
        start = time.perf_counter()
        if self.kind == "blockfs":
            command = [
                sys.executable,
                "-m",
                "blockfs",
                "mount",
                str(self.what),
                str(self.mnt),
                "--fuse",
                self.route,
                "--log",
                log,
            ]
            subprocess.run(
                command, env=self.env, check=True, stdout=subprocess.DEVNULL, cwd="/"
            )  # returns once it serves
            seconds = time.perf_counter() - start
            self.pid = serving_pid(self.mnt, timeout=30)
        else:  # null_fs: a foreground server, mounted once it has walked SRC
            with open(log, "ab") as f:
                self.proc = subprocess.Popen(
                    [sys.executable, str(HELPERS / "null_fs.py"), str(self.what), str(self.mnt), "--fuse", self.route],
                    stdout=f,
                    stderr=f,
                    stdin=subprocess.DEVNULL,
                )
            wait_until_mounted(self.mnt, self.proc, 3600, log)
            seconds = time.perf_counter() - start
            self.pid = self.proc.pid
        return seconds

    def stop(self) -> None:
        unmount(self.mnt)
        if self.proc is not None:
            self.proc.wait(60)
            self.proc = None


def measure_tree(name: str, root: Path, sample: list[str], mount: Mount | None) -> dict:
    """Listing, reads after it, the kernel-served pass, then reads with no listing on a fresh start."""
    out: dict = {"system": name}
    drop_caches(3)
    if mount is not None:
        out["mount_s"] = mount.start()
        out["rss_anon_at_mount"] = rss_anon(mount.pid)
    try:
        out["listing"] = walk(root)
        out["rss_anon_after_listing"] = rss_anon(mount.pid) if mount else None
        drop_caches(1)  # the page cache only: the listed dentries and inodes stay
        out["read_after_listing"] = read_sample(root, sample)
        out["read_again"] = read_sample(root, sample)  # the kernel-served pass
        out["rss_anon_after_reads"] = rss_anon(mount.pid) if mount else None
    finally:
        if mount is not None:
            mount.stop()
    drop_caches(3)
    if mount is not None:
        out["mount_again_s"] = mount.start()
    try:
        out["read_without_listing"] = read_sample(root, sample)
    finally:
        if mount is not None:
            mount.stop()
    return out


# --- the run -----------------------------------------------------------------------------------------
def pack(args: argparse.Namespace, dest: Path) -> dict:
    """Pack the synthetic source in a child process (``--code``'s blockfs), measured from outside."""
    env = dict(os.environ)
    code = str(Path(args.code).resolve()) if args.code else str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([code, str(HELPERS)])
    program = (
        "import sys, json, blockfs; from synthetic_source import SyntheticSource; "
        f"r = blockfs.pack(SyntheticSource({args.files}, {args.dirs}, {args.seed}), {str(dest)!r}, force=True); "
        "print(json.dumps({'n_files': r.n_files, 'n_blocks': r.n_blocks, 'seconds_inside': r.seconds, "
        "'blockfs_from': blockfs.__file__}))"
    )
    shutil.rmtree(dest, ignore_errors=True)
    result = timed_child([sys.executable, "-c", program], env)
    result.update(json.loads(result.pop("stdout").strip().splitlines()[-1]))
    result["code"] = code
    return result


def dataset_tools(args: argparse.Namespace, dest: Path) -> dict:
    """``blockfs info``, ``verify``, ``ls`` of one directory and the loader's epoch order (and ``unpack``
    with ``--unpack``) on the packed dataset: time and peak memory of each, run as a user runs them."""
    env = dict(os.environ, PYTHONPATH=str(Path(args.code).resolve()) if args.code else str(ROOT))
    cli = [sys.executable, "-m", "blockfs"]
    order = (
        "import blockfs; from blockfs.loader.order import BlockLayout, block_shuffled_order; "
        f"ds = blockfs.open_dataset({str(dest)!r}); a = ds.index.arrays; "
        "o = block_shuffled_order(BlockLayout(a['block_offsets'], a['block_files']), seed=0, epoch=0, num_workers=4, worker=1); "
        "print(len(o))"
    )
    runs = {
        "info": cli + ["info", str(dest)],
        "verify": cli + ["verify", "-q", str(dest)],
        "ls": cli + ["ls", str(dest), "n00000000"],
        "loader order": [sys.executable, "-c", order],
    }
    if args.unpack:
        shutil.rmtree(dest.parent / "unpacked", ignore_errors=True)
        runs["unpack"] = cli + ["unpack", "-q", str(dest), str(dest.parent / "unpacked")]
    out = {}
    for name, command in runs.items():
        result = timed_child(command, env)
        result.pop("stdout")
        out[name] = result
    shutil.rmtree(dest.parent / "unpacked", ignore_errors=True)
    return out


def sample_names(source: SyntheticSource, n: int, seed: int) -> list[str]:
    """``n`` distinct files picked at random, by their place in the source (no list of every file)."""
    picks = random.Random(seed).sample(range(source.files), min(n, source.files))
    return [os.fsdecode(source.path_of(g)) for g in picks]


def table(r: dict) -> str:
    def fmt_bytes(b: int | None) -> str:
        return "—" if b is None else f"{b / 1e6:,.0f} MB"

    lines = [
        f"{r['files']:,} files in {r['dirs']:,} directories, sample {r['sample']:,}, route {r['route']}"
        f" ({r['machine']})",
        "",
    ]
    p = r["pack"]
    lines.append(
        f"pack (synthetic source): {p['seconds']:.1f} s, peak RSS {fmt_bytes(p['peak_rss'])}, {p['n_blocks']} blocks"
    )
    for name, t in r.get("tools", {}).items():
        lines.append(f"{name}: {t['seconds']:.1f} s, peak RSS {fmt_bytes(t['peak_rss'])}")
    systems = [s for s in (r.get("blockfs"), r.get("plain"), r.get("null_fs")) if s]
    if not systems:
        return "\n".join(lines)
    rows = [
        ("start (mount returns / null_fs ready)", lambda s: f"{s['mount_s']:.2f} s" if "mount_s" in s else "—"),
        ("listing (os.walk)", lambda s: f"{s['listing']['seconds']:.2f} s"),
        ("kernel slab grew by the listing", lambda s: fmt_bytes(s["listing"]["slab_grew"])),
        ("server RssAnon at mount", lambda s: fmt_bytes(s.get("rss_anon_at_mount"))),
        ("server RssAnon after the listing", lambda s: fmt_bytes(s.get("rss_anon_after_listing"))),
        ("reads after the listing (files/s)", lambda s: f"{s['read_after_listing']['files_s']:,.0f}"),
        ("the same again, kernel-served", lambda s: f"{s['read_again']['files_s']:,.0f}"),
        ("reads with no listing first", lambda s: f"{s['read_without_listing']['files_s']:,.0f}"),
    ]
    lines.append("")
    lines.append("| step | " + " | ".join(s["system"] for s in systems) + " |")
    lines.append("|---" * (len(systems) + 1) + "|")
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(s) for s in systems) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--dirs", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", type=int, default=200_000, help="files read in each read pass")
    parser.add_argument("--no-plain", action="store_true", help="no plain tree (the default above 2,000,000 files)")
    parser.add_argument("--plain", action="store_true", help="a plain tree even above 2,000,000 files")
    parser.add_argument("--no-null", action="store_true", help="skip null_fs (it holds the whole tree in Python)")
    parser.add_argument("--pack-only", action="store_true", help="measure the pack (and the tools) and stop")
    parser.add_argument("--no-tools", action="store_true", help="skip info, verify, ls and the loader's order")
    parser.add_argument("--unpack", action="store_true", help="also time unpack (writes every file again)")
    parser.add_argument("--fuse", choices=("kernel", "mfusepy"), default=os.environ.get("BLOCKFS_FUSE") or "kernel")
    parser.add_argument("--code", help="a checkout whose blockfs packs (default: this one), for a before and after")
    parser.add_argument("--work", help="where the datasets go, kept (default: a temporary directory, removed)")
    parser.add_argument("--reuse", action="store_true", help="use the dataset packed in --work by an earlier run")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    plain = (args.files <= PLAIN_UP_TO or args.plain) and not args.no_plain and not args.pack_only

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    source = SyntheticSource(args.files, args.dirs, args.seed)
    results: dict = {
        "files": args.files,
        "dirs": args.dirs,
        "sample": min(args.sample, args.files),
        "route": args.fuse,
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "root": os.geteuid() == 0,
        "argv": sys.argv[1:],
    }
    started = time.monotonic()

    def say(what: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {what}", file=sys.stderr, flush=True)

    try:
        dest = work / "ds"
        if args.reuse and (dest / "blockfs.json").exists():
            say(f"reusing {dest} (not timed)")
            results["pack"] = {
                "seconds": float("nan"),
                "peak_rss": None,
                "n_blocks": json.loads((dest / "blockfs.json").read_text())["n_blocks"],
            }
        else:
            say(f"pack {args.files:,} synthetic files")
            results["pack"] = pack(args, dest)
            say(f"packed in {results['pack']['seconds']:.1f} s, peak RSS {results['pack']['peak_rss'] / 1e6:,.0f} MB")
        if not args.no_tools:
            say("info, verify, ls, the loader's order" + (", unpack" if args.unpack else ""))
            results["tools"] = dataset_tools(args, dest)
        if not args.pack_only:
            sample = sample_names(source, args.sample, args.seed + 1)
            env = dict(os.environ, PYTHONPATH=str(Path(args.code).resolve()) if args.code else str(ROOT))
            compiled(env["PYTHONPATH"])  # the mount is timed: not its compiling
            say("blockfs: mount, listing, reads")
            results["blockfs"] = measure_tree(
                "blockfs", work / "mnt", sample, Mount("blockfs", dest, work / "mnt", args.fuse, env)
            )
            if plain:
                tree = work / "plain"
                if not (tree / ".complete").exists():
                    say(f"write the plain tree ({args.files:,} files)")
                    shutil.rmtree(tree, ignore_errors=True)
                    write_tree(source, str(tree))
                    (tree / ".complete").touch()
                say("plain directory: listing, reads")
                results["plain"] = measure_tree("plain directory", tree, sample, None)
                results["plain"]["listing"]["files"] -= 1  # .complete
                if not args.no_null:
                    say("null_fs on the plain tree")
                    null = Mount("null_fs", tree, work / "nullmnt", args.fuse, env)
                    results["null_fs"] = measure_tree(f"null_fs ({args.fuse})", work / "nullmnt", sample, null)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    results["cache_drops"] = drop_caches(1)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
