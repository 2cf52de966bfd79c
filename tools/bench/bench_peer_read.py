"""CPU per file of a read through a peer, each side apart: the asker (verifier, chain, PeerTier, PeerClient)
and the owner (PeerEndpoint serving the block from memory).

    python tools/bench/bench_peer_read.py [--files 600] [--reads 3000] [--threads 4] [--rounds 5]
                                          [--section-rounds 3] [--before LABEL=DIR ...] [--json out.json]

A dataset of ``--files`` files of 10-100 KiB (bench_nodes' sizes) packed in 1 MiB blocks into a temporary
directory.  Two processes per checkout: an owner (``--role serve``) that holds every block in a
``BlockCache`` and serves them with :class:`~blockfs.serve.peer_endpoint.PeerEndpoint` on loopback, and an
asker (``--role read``) that opens the same directory with a :class:`~blockfs.storage.peer_tier.PeerTier`
in its chain whose owner of every block is the other process, then reads ``--reads`` random files
(``read_entry``: header, file, BLAKE3 check) with ``--threads`` threads.  Then the same asker reads the same
files from its local block files (no peer tier: ``local``), so ``peer - local`` is what the peer costs the
asker.  Then a second asker reads every block's whole data section ``--section-rounds`` times through the
peer (``read_data_into`` into a ``bytearray``, verified by its chunk digests: what the cache's window of
another node's blocks costs), then from local files; those figures are per file the sections hold.  CPU
is each process's user + system time (``os.times``) over the reads.

``--before LABEL=DIR`` runs a second checkout's ``blockfs`` (``git archive main blockfs | tar -x -C DIR``)
in the same rounds, each checkout in turn (order rotated each round), both processes on its code; medians
over ``--rounds``.  ``--role`` is internal.  The machine's other load moves the figures: read them as
ratios within one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SECRET = b"bench-peer-read-secret"
HERE = Path(__file__).resolve().parents[2]


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def make_dataset(root: Path, files: int, seed: int) -> Path:
    import blockfs

    rng = random.Random(seed)
    src = root / "src"
    for i in range(files):
        d = src / f"c{i % 8}"
        d.mkdir(parents=True, exist_ok=True)
        size = rng.randint(10 << 10, 100 << 10)
        (d / f"{i:05}.bin").write_bytes(hashlib.shake_256(str(i).encode()).digest(size))
    blockfs.pack(src, root / "packed", block_size=1 << 20, fsync=False)
    return root / "packed"


def serve(packed: str) -> None:
    """The owner: every block in memory, served until stdin closes; ``cpu`` on stdin prints its CPU."""
    import blockfs
    from blockfs.serve import peer_endpoint
    from blockfs.serve.cache.block_cache import BlockCache
    from blockfs.serve.peer_endpoint import PeerEndpoint
    from blockfs.storage.peer_tier import ServedCounts

    peer_endpoint.IDLE_S = 600.0
    if os.environ.get("BENCH_PEER_PROFILE"):  # --profile: each connection's thread under cProfile
        import cProfile

        handle = peer_endpoint._Connection.handle

        def profiled(self: peer_endpoint._Connection) -> None:
            prof = cProfile.Profile()
            prof.runcall(handle, self)
            prof.dump_stats(f"{os.environ['BENCH_PEER_PROFILE']}/owner-{threading.get_ident()}.prof")

        peer_endpoint._Connection.handle = profiled  # type: ignore[method-assign]
    with blockfs.open_dataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, lock_memory=False)
        for b in range(ds.store.n_blocks):
            cache.load(b)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ep = PeerEndpoint(f"127.0.0.1:{port}", ds.digest, SECRET, ds.store, cache, lambda b: True, ServedCounts("x"))
        print(ep.address, flush=True)
        for line in sys.stdin:
            if line.strip() == "cpu":
                print(f"{cpu():.6f}", flush=True)
        ep.close()


def read(packed: str, address: str, reads: int, threads: int, seed: int) -> None:
    """The asker: ``reads`` random files through the peer, then the same from local files; prints JSON."""
    import blockfs
    from blockfs.core.index import KIND_FILE
    from blockfs.storage.chain import compose
    from blockfs.storage.peer_tier import PeerOptions, PeerTier

    with blockfs.open_dataset(packed) as ds:
        entries = [e for e in range(ds.index.n_entries) if ds.index.kind(e) == KIND_FILE]
        rng = random.Random(seed)
        picks = [rng.choice(entries) for _ in range(reads)]
        local = ds.store._files
        sizes = [int(local.size(b)) for b in range(ds.store.n_blocks)]
        tier = PeerTier(PeerOptions(("127.0.0.1:1", address), 0, SECRET, timeout=60.0), ds.digest, sizes)
        tier.set_owners([1] * len(sizes))
        peered = compose(local, peers=tier)
        out = {}
        for name, files in (("warm", peered), ("peer", peered), ("local", local)):
            ds.store._files = files
            todo = picks[:200] if name == "warm" else picks
            parts = [todo[i::threads] for i in range(threads)]

            def run(part: list[int], name: str = name) -> None:
                if name == "peer" and os.environ.get("BENCH_PEER_PROFILE"):
                    import cProfile

                    prof = cProfile.Profile()
                    prof.runcall(lambda: [ds.read_entry(e) for e in part])
                    prof.dump_stats(f"{os.environ['BENCH_PEER_PROFILE']}/asker-{threading.get_ident()}.prof")
                    return
                for e in part:
                    ds.read_entry(e)

            ts = [threading.Thread(target=run, args=(p,)) for p in parts]
            c0, w0 = cpu(), time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            out[name] = {"cpu": cpu() - c0, "wall": time.perf_counter() - w0, "n": len(todo)}
        out["fetches"] = tier.stats()["peers"]["by_peer"][address]["fetches"]
        ds.store._files = local
        tier.close()
        print(json.dumps(out), flush=True)


def read_sections(packed: str, address: str, rounds: int) -> None:
    """The asker, reading whole data sections (the cache's window of another node's blocks): every block's
    through the peer, verified (``read_data_into``), ``rounds`` times; then from local files; prints JSON."""

    import blockfs
    from blockfs.storage.chain import compose
    from blockfs.storage.peer_tier import PeerOptions, PeerTier

    with blockfs.open_dataset(packed) as ds:
        local = ds.store._files
        sizes = [int(local.size(b)) for b in range(ds.store.n_blocks)]
        tier = PeerTier(PeerOptions(("127.0.0.1:1", address), 0, SECRET, timeout=60.0), ds.digest, sizes)
        tier.set_owners([1] * len(sizes))
        peered = compose(local, peers=tier)
        heads = [ds.store.header(b) for b in range(ds.store.n_blocks)]
        files = sum(len(h.sizes) for h in heads)
        out = {}
        for name, where in (("sections", peered), ("sections_local", local)):
            ds.store._files = where
            c0, w0 = cpu(), time.perf_counter()
            for _ in range(rounds):
                for b, head in enumerate(heads):
                    ds.store.read_data_into(b, head, bytearray(head.data_size))  # as the window does
            out[name] = {"cpu": cpu() - c0, "wall": time.perf_counter() - w0, "n": rounds * files}
        ds.store._files = local
        tier.close()
        print(json.dumps(out), flush=True)


def one(label: str, root: Path, packed: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    me = [sys.executable, __file__]
    owner = subprocess.Popen(
        [*me, "--role", "serve", str(packed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        address = owner.stdout.readline().strip()

        def owner_cpu() -> float:
            owner.stdin.write("cpu\n")  # type: ignore[union-attr]
            owner.stdin.flush()  # type: ignore[union-attr]
            return float(owner.stdout.readline())  # type: ignore[union-attr]

        before = owner_cpu()
        done = subprocess.run(
            [*me, "--role", "read", str(packed), address, str(args.reads), str(args.threads), str(args.seed)],
            env=env,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        served = owner_cpu() - before  # warm-up's reads included: scaled by the files it served
        before = owner_cpu()
        done = subprocess.run(
            [*me, "--role", "sections", str(packed), address, str(args.section_rounds)],
            env=env,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        got |= json.loads(done.stdout.strip().splitlines()[-1])
        served_sections = owner_cpu() - before
    finally:
        owner.stdin.close()  # type: ignore[union-attr]
        owner.wait(timeout=30)
    n_peer = got["peer"]["n"] + got["warm"]["n"]
    us = 1e6
    return {
        "label": label,
        "asker_peer_us": got["peer"]["cpu"] / got["peer"]["n"] * us,
        "asker_local_us": got["local"]["cpu"] / got["local"]["n"] * us,
        "owner_us": served / n_peer * us,
        "wall_peer_us": got["peer"]["wall"] / got["peer"]["n"] * us,
        "gets_per_file": got["fetches"] / n_peer,
        # a whole data section a request, per file it holds (the window's cost, spread over the block's files)
        "asker_section_us": got["sections"]["cpu"] / got["sections"]["n"] * us,
        "asker_section_local_us": got["sections_local"]["cpu"] / got["sections_local"]["n"] * us,
        "owner_section_us": served_sections / got["sections"]["n"] * us,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=600)
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--before", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", type=Path, help="cProfile each side's threads into this directory (slower)")
    ap.add_argument("--section-rounds", type=int, default=3, help="passes over every block's data section")
    ap.add_argument("--role", choices=["serve", "read", "sections"])
    args, rest = ap.parse_known_args(argv)
    if args.role == "serve":
        serve(rest[0])
        return 0
    if args.role == "sections":
        read_sections(rest[0], rest[1], int(rest[2]))
        return 0
    if args.role == "read":
        read(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
        return 0
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        os.environ["BENCH_PEER_PROFILE"] = str(args.profile.resolve())
    checkouts = [("this", HERE)] + [(b.split("=", 1)[0], Path(b.split("=", 1)[1]).resolve()) for b in args.before]
    keys = (
        "asker_peer_us",
        "asker_local_us",
        "owner_us",
        "wall_peer_us",
        "gets_per_file",
        "asker_section_us",
        "asker_section_local_us",
        "owner_section_us",
    )
    results: dict[str, list[dict]] = {label: [] for label, _ in checkouts}
    with tempfile.TemporaryDirectory(prefix="bench-peer-read-") as tmp:
        packed = make_dataset(Path(tmp), args.files, args.seed)
        for r in range(args.rounds):
            order = checkouts[r % len(checkouts) :] + checkouts[: r % len(checkouts)]
            for label, root in order:
                got = one(label, root, packed, args)
                results[label].append(got)
                print(f"round {r + 1} {label}: " + ", ".join(f"{k} {got[k]:.1f}" for k in keys), file=sys.stderr)
    print(
        "| checkout | asker µs CPU/file, peer | asker, local | asker, peer − local | owner µs CPU/file | "
        "wall µs/file | GETs/file | whole sections, µs CPU/file: asker peer, asker local, owner |"
    )
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for label, rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in keys}
        med["asker_extra_us"] = statistics.median(row["asker_peer_us"] - row["asker_local_us"] for row in rows)
        summary[label] = med
        print(
            f"| {label} | {med['asker_peer_us']:.0f} | {med['asker_local_us']:.0f} | {med['asker_extra_us']:.0f} | "
            f"{med['owner_us']:.0f} | {med['wall_peer_us']:.0f} | {med['gets_per_file']:.2f} | "
            f"{med['asker_section_us']:.0f}, {med['asker_section_local_us']:.0f}, {med['owner_section_us']:.0f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rounds": results, "medians": summary}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
