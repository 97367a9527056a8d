"""Workers sharing one ``--l3-dir``: a live worker's cache is never deleted by another worker.

A worker drops the cache directories of other model fingerprints at start-up (a model change drops the
old cache), but only those no live worker holds: each worker holds its directory's lock file (flock)
while it runs. A second worker of the same model on the same root is refused: two processes writing and
evicting one index's files would delete each other's files under them."""

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.worker_process import free_port, worker_process

ARGS = ("--num-blocks", "64", "--max-model-len", "1008", "--l3-min-free-bytes", "0")


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/stats", timeout=10) as response:
        return json.loads(response.read())


def _model_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and len(p.name) == 16}


def test_a_live_worker_of_another_model_keeps_its_cache_and_a_stopped_ones_is_dropped(tmp_path):
    root = tmp_path / "kv"
    with worker_process("--model", "random-tiny", *ARGS, "--l3-dir", str(root), log_path=tmp_path / "a.log"):
        (tiny_dir,) = _model_dirs(root)
        kept = root / tiny_dir / "t-a" / ("ab" * 32 + ".kv")  # stands for a file of its cache
        kept.parent.mkdir()
        kept.write_bytes(b"not read by anyone until the tiny worker restarts")
        with worker_process(
            "--model", "random-small", *ARGS, "--l3-dir", str(root), log_path=tmp_path / "b.log"
        ) as other:
            l3 = _stats(other)["tiers"]["l3"]
            assert kept.exists(), "the other model's worker deleted a live worker's cache"
            assert l3.get("foreign_deleted_total", 0) == 0 and l3["foreign_live_kept_total"] == 1
    assert kept.exists()  # the tiny worker is gone now: the next worker of another model drops its cache
    with worker_process("--model", "random-small", *ARGS, "--l3-dir", str(root), log_path=tmp_path / "c.log"):
        assert not (root / tiny_dir).exists()
        assert len(_model_dirs(root)) == 1


def test_a_second_worker_of_the_same_model_on_the_same_directory_is_refused(tmp_path):
    root = tmp_path / "kv"
    args = ("--model", "random-tiny", *ARGS, "--l3-dir", str(root))
    with worker_process(*args, log_path=tmp_path / "a.log") as first:
        second = subprocess.run(
            [sys.executable, "-m", "worker", "--port", str(free_port()), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("prefixgate worker: ") and "in use by another worker" in last, last
        assert "--l3-dir" in last
        assert _stats(first)["tiers"]["l3"]["accepting"] == 1  # the first one serves on, untouched


@pytest.mark.parametrize("holder", ["live", "stale lock file"])
def test_a_disk_tier_drops_only_unheld_foreign_directories(tmp_path, holder):
    import torch

    from worker.tiers.disk import DiskTier

    def tier(fingerprint: bytes) -> DiskTier:
        return DiskTier(
            tmp_path,
            budget_bytes=1 << 20,
            fingerprint=fingerprint,
            codec="none",
            block_shape=(2, 2, 16, 2, 16),
            dtype=torch.float32,
            min_free_bytes=0,
        )

    first = tier(b"\x01" * 32)
    (first.dir / "t-a").mkdir()
    (first.dir / "t-a" / "x.kv").write_bytes(b"x")
    if holder == "stale lock file":
        first.close()  # its lock file stays, held by no one (a worker that died)
    second = tier(b"\x02" * 32)
    assert first.dir.exists() is (holder == "live")
    assert second.counters["foreign_deleted_total"] == (0 if holder == "live" else 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("~")]  # no trash left behind
    second.close()
    first.close()
