"""The context-parallel tools on CPU processes (gloo, with torchrun's environment):
tools/cp_check.py on 2 and 3 ranks at small sizes (every layout and pattern source, head dim 64,
fp32, the error checks) must pass; with a perturbed rank it must fail (the checker can fail);
tools/bench_cp_torch.py at a tiny size on 2 ranks must run the methods that run on the CPU and
report torch's own context parallel as skipped with its reason, with the JSON's fields."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtrain

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(world: int, script: str, *args: str, timeout: float = 240) -> tuple[int, str]:
    """Runs tools/<script> on `world` CPU processes with torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; without torchrun's agent, which costs seconds
    here); returns the worst exit status and rank 0's output."""
    env = dict(os.environ)
    # the mtrain this test imported (installed, or the sources with MTRAIN_LIBRARY)
    pkg = str(Path(mtrain.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("MTRAIN_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MTRAIN_COMM_TIMEOUT", "60")
    env.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})  # fmt: skip
    cmd = [sys.executable, str(TOOLS / script), "--device", "cpu", *args]
    procs = []
    for r in range(world):
        env_r = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        out = subprocess.PIPE if r == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, env=env_r, cwd=ROOT, stdout=out,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    try:
        text, _ = procs[0].communicate(timeout=timeout)
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(text[-8000:])
    return max(codes, key=abs), text


@pytest.mark.parametrize("world", [2, 3])
def test_cp_check_passes(world: int, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    lens = "301,187,122" if world == 2 else "201,133,90"
    rc, text = launch(world, "cp_check.py", "--head-dims", "64", "--seq-lens", lens,
                      "--json", str(out))  # fmt: skip
    assert rc == 0, "cp_check failed (output above)"
    doc = json.loads(out.read_text())
    assert doc["world"] == world and doc["passed"]
    cases = doc["cases"]
    assert len(cases) == 16  # 4 layouts x 4 sources
    assert {c["layout"] for c in cases} == {"striped", "zigzag", "balanced", "contiguous"}
    assert {c["source"] for c in cases} == {"topk", "budgets", "dense", "blockmask"}
    for c in cases:
        assert c["passed"], c
        assert set(c["vs_single"]) == {"o", "lse", "dq", "dk", "dv"}
        assert set(c["vs_fp64"]) == {"o", "lse", "dq", "dk", "dv"}
        if c["source"] in ("topk", "budgets"):
            assert c["patterns_equal"] is True
    # the estimate with TopK(8, 48) and the random block masks are really sparse here
    dens = {c["source"]: c["density"] for c in cases}
    assert dens["dense"] == 1.0 and dens["topk"] < 0.9 and dens["blockmask"] < 0.9
    checks = doc["error_checks"]
    assert len(checks) == 3 and all(c["passed"] for c in checks), checks
    assert "PASS" in text


def test_cp_check_catches_a_perturbed_rank(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    rc, text = launch(2, "cp_check.py", "--head-dims", "64", "--layouts", "striped,zigzag",
                      "--sources", "dense", "--no-error-checks", "--perturb-rank", "1",
                      "--seq-lens", "101,67", "--json", str(out))  # fmt: skip
    assert rc == 1
    doc = json.loads(out.read_text())
    assert not doc["passed"]
    assert len(doc["cases"]) == 2 and not any(c["passed"] for c in doc["cases"])
    assert "FAIL" in text


def test_bench_cp_torch_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc, text = launch(2, "bench_cp_torch.py", "--seq-lens", "512", "--head-dim", "64",
                      "--warmup", "1", "--reps", "1", "--json", str(out))  # fmt: skip
    assert rc == 0, "bench_cp_torch failed (output above)"
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["device"] == "cpu" and doc["failed"] == 0
    assert doc["heads"] == 16 and doc["kv_heads"] == 2 and doc["head_dim"] == 64
    res = {r["method"]: r for r in doc["results"]}
    assert set(res) == {"mtrain-sparse", "mtrain-dense", "torch-cp", "ring-peer"}
    skipped = res["torch-cp"]
    print(f"torch-cp on the CPU: {skipped['status']}: {skipped.get('reason')}")
    assert skipped["status"] == "skipped" and skipped["reason"]
    for name in ("mtrain-sparse", "mtrain-dense", "ring-peer"):
        r = res[name]
        assert r["status"] == "ok", r
        assert r["seq_len"] == 512
        assert 0 < r["fwd_s"] <= r["fwdbwd_s"]
        assert r["tokens_per_s"] == pytest.approx(512 / r["fwdbwd_s"])
        assert len(r["peak_gib_per_rank"]) == 2 and min(r["peak_gib_per_rank"]) > 0
        assert len(r["fwdbwd_runs"]) == 1
    for name in ("mtrain-sparse", "mtrain-dense"):
        rc = res[name]["ring_over_compute"]
        assert rc["fwd"] > 0 and rc["bwd"] > 0 and len(rc["per_rank"]) == 2
    assert 0 < res["mtrain-sparse"]["density"] <= 1
    assert res["mtrain-sparse"]["est_s"] > 0
    parts = res["mtrain-sparse"]["estimate_parts_s"]
    assert len(parts["per_rank"]) == 2 and parts["stages"] > 0 and parts["select"] > 0
    assert parts["stages"] + parts["select"] <= res["mtrain-sparse"]["est_s"] * 1.5
    assert res["ring-peer"]["ring_over_compute"] is None
    assert "| 512 | mtrain-sparse | ok |" in text
