"""benchmarks/peers.py: our side of every pair runs, and the report's ratios and targets are right.

The peers themselves are an optional install (`make peers`), so CI runs only our side.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnzoo

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(spec)
sys.modules["peers"] = peers  # dataclasses look their module up
spec.loader.exec_module(peers)


@pytest.mark.parametrize("pair", sorted(peers.PAIRS))
def test_our_side_of_every_pair_runs(pair):
    result = peers.child(pair, "ours", 40, repeats=1, backward=True, threads=1)
    assert result["status"] == "ok" and result["bwd_status"] == "ok", result
    assert len(result["fwd_s"]) == peers.calls_for(result["fwd_first_s"], 1) and result["fwdbwd_s"][0] > 0
    for key in ("fwd", "fwdbwd"):  # kernel time and page faults of every timed call
        n = len(result[f"{key}_s"])
        assert len(result[f"{key}_sys_s"]) == len(result[f"{key}_faults"]) == n
        assert all(t >= 0 for t in result[f"{key}_sys_s"]) and all(f >= 0 for f in result[f"{key}_faults"])


def test_fast_calls_are_timed_more_often():
    assert peers.calls_for(2.0, 3) == 3  # slow: the given repeats
    assert peers.calls_for(peers.TIMED_S / 10, 3) == 10  # fast: about TIMED_S of calls
    assert peers.calls_for(1e-9, 3) == peers.MAX_REPEATS


def test_child_process_prints_one_result():
    argv = ["--child", "linear", "ours", "33", "--repeats", "2", "--no-backward"]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), *argv],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.splitlines()[-1].removeprefix("RESULT:"))
    assert result["status"] == "ok" and "fwdbwd_s" not in result and "fwd_peak_bytes" not in result
    assert len(result["fwd_s"]) == peers.calls_for(result["fwd_first_s"], 2)


def test_memory_child_needs_the_fixed_mmap_threshold_from_its_start():
    """The memory calls run in a process of their own, started with memory_env; one started
    without it refuses, rather than read the heap's state as the call's memory."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--child", "linear", "ours", "33",
            "--part", "memory", "--no-backward"]
    bare_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="")
    bare = subprocess.run(argv, capture_output=True, text=True, env=bare_env)
    assert bare.returncode != 0 and "MALLOC_MMAP_THRESHOLD_=131072" in bare.stderr
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=peers.memory_env())
    result = json.loads(out.stdout.splitlines()[-1].removeprefix("RESULT:"))
    assert result["status"] == "ok" and "fwd_s" not in result
    if Path("/proc/self/clear_refs").exists():
        assert len(result["fwd_peak_bytes"]) == peers.MEMORY_CALLS


def test_a_round_of_a_side_is_a_memory_process_then_a_timed_one(monkeypatch):
    """run_child: the memory process gets the fixed threshold, the timed one glibc's defaults;
    the round's result has the timed calls, the memory calls and both processes' wall time."""
    started = []

    def fake_run(cmd, env, **kwargs):
        part = cmd[cmd.index("--part") + 1]
        started.append((part, env.get("MALLOC_MMAP_THRESHOLD_"), env["OMP_NUM_THREADS"]))
        result = {"status": "ok", "fwd_first_s": 0.1}
        result.update({"fwd_peak_bytes": [7]} if part == "memory" else {"fwd_s": [0.2]})
        return subprocess.CompletedProcess(cmd, 0, "noise\nRESULT:" + json.dumps(result), "")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    args = peers.argparse.Namespace(repeats=3, threads=2, no_backward=False, child_timeout=10.0)
    result = peers.run_child("linear", "ours", 17, args)
    assert started == [("memory", "131072", "2"), ("time", None, "2")]
    assert result["fwd_s"] == [0.2] and result["fwd_peak_bytes"] == [7]
    assert result["child_s"] >= result["memory_child_s"] >= 0


def _doc(cells):
    machine = {"cpu": "test", "cores": 2, "threads": 2, "torch": "2.13.0", "python": "3.11",
               "matmul_gflops": 100.0}
    return {"created": "now", "command": "peers.py", "wall_s": 1, "machine": machine,
            "lengths": [4096, 16384], "repeats": 3, "rounds": 1, "cells": cells}


def _side(fwd, mib):
    return {"status": "ok", "fwd_s": fwd, "fwdbwd_s": 3 * fwd, "fwd_mib": mib, "fwdbwd_mib": 2 * mib}


def test_report_ratios_and_targets():
    cells = {
        "full/4096": {"ours": _side(0.30, 9), "peer": _side(0.29, 9)},  # 1.03: within 5% of SDPA
        "full/16384": {"ours": _side(4.4, 33), "peer": _side(4.0, 33)},  # 1.10: not
        "efficient/16384": {"ours": _side(0.05, 40), "peer": _side(0.11, 96)},  # 0.45 ✓, 0.42 ✓
        "lsh/16384": {"ours": _side(1.2, 300), "peer": _side(2.0, 1600)},  # 0.60 ✗ in time
        "log_sparse/16384": {"ours": _side(0.2, 200)},
    }
    text = peers.report(_doc(cells))
    full = [line for line in text.splitlines() if line.startswith("| full | torch SDPA |")]
    assert "1.03 ✓" in full[0] and "1.10 ✗" in full[1]
    efficient = next(line for line in text.splitlines() if line.startswith("| efficient |"))
    assert "0.45 ✓" in efficient and "0.42 ✓" in efficient
    lsh = next(line for line in text.splitlines() if line.startswith("| lsh | reformer"))
    assert "0.60 ✗" in lsh and "0.19 ✓" in lsh  # memory 300 / 1600
    vs_sdpa = next(line for line in text.splitlines() if line.startswith("| log_sparse | no"))
    assert "0.05 ✓" in vs_sdpa  # 0.2 s against SDPA's 4.0 s at 16384: ≤ 0.2


def test_report_summary_counts_the_marks_and_gives_each_miss():
    """The summary counts every ✓ and ✗ of the tables and names each miss with the time that
    meets it; a time missed gets what that asks of the FLOP floor beside SDPA's own, and a miss
    with a known cause gets it."""
    floor = peers.floor_s(peers.PAIRS["nystrom"], 4096, _doc({}))
    sdpa_floor = peers.floor_s(peers.PAIRS["full"], 4096, _doc({}))
    cells = {
        "full/4096": {"ours": _side(1.01 * sdpa_floor, 9), "peer": _side(sdpa_floor, 9)},  # 4 ✓
        "nystrom/4096": {"ours": _side(0.30, 40), "peer": {**_side(1.0, 200), "fwdbwd_s": 1.5}},
        "log_sparse/4096": {"ours": _side(2.0 * sdpa_floor, 9)},  # 2.0 against SDPA: ✗
    }
    text = peers.report(_doc(cells))
    summary = text.split("## Summary")[1].split("## Ours against the peer")[0]
    assert "7 of 9 marked ratios meet their target:" in summary  # full 4, nystrom 4, log_sparse 1
    table_marks = [cell.strip()[-1] for line in text.splitlines() if line.startswith("|")
                   for cell in line.split("|") if cell.strip().endswith(("✓", "✗"))]
    assert len(peers.marks(_doc(cells))) == len(table_marks) == 9 and table_marks.count("✗") == 2
    nystrom = next(line for line in summary.splitlines() if line.startswith("- ✗ `nystrom`"))
    need = 0.5 * 1.5 / (peers.STEP_WORK * floor)  # 0.5 of the peer's 1.5 s over the step's floor
    assert ("training-step time against the peer: 900 ms / 1500 ms = 0.60, target ≤ 0.5: met at 750 ms"
            in nystrom)
    assert f"That is {need:.2f}× its FLOP floor (the forward's × 3), where SDPA's own took 1.00×" in nystrom
    assert "Why: nearly all of this step" in summary
    log_sparse = next(line for line in summary.splitlines() if line.startswith("- ✗ `log_sparse`"))
    assert "forward time against SDPA" in log_sparse and "= 2.00, target ≤ 1:" in log_sparse
    met = {"full/4096": cells["full/4096"]}
    assert "4 of 4 marked ratios meet their target." in peers.report(_doc(met))


def test_render_rewrites_the_report_from_its_json(tmp_path):
    """--render: the report anew from the run's JSON, the same text report() gives, no run."""
    out = tmp_path / "perf.md"
    doc = _doc({"efficient/16384": {"ours": _side(0.05, 40), "peer": _side(0.11, 96)}})
    out.with_suffix(".json").write_text(json.dumps(doc))
    out.write_text("stale")
    peers.main(["--render", "--out", str(out)])
    assert out.read_text() == peers.report(doc) and "| efficient |" in out.read_text()


def test_report_gives_each_time_over_its_floor_and_the_target_it_sets():
    """Each time's target follows from the peer's own over its floor, the forward's or the
    training step's (3× it): 1.0 within 2×, else 0.5; memory has no floor, so always 0.5."""
    floor = peers.floor_s(peers.PAIRS["linformer"], 4096, _doc({}))
    cells = {"linformer/4096": {"ours": {**_side(1.4 * floor, 60), "fwdbwd_s": 4.5 * floor},
                                "peer": {**_side(1.9 * floor, 100), "fwdbwd_s": 7.5 * floor}},
             "linformer/16384": {"ours": _side(0.6, 9), "peer": _side(1.0, 9)},  # 2.9× its floor
             "log_sparse/16384": {"ours": _side(0.2, 200)}}  # no peer: no row
    text = peers.report(_doc(cells))
    rows = [line for line in text.split("## Time over the FLOP floor")[1].splitlines()
            if line.startswith("| linformer |")]
    # forward: the peer within 2× (target 1); training step: 2.5× the step's floor (target 0.5)
    assert rows[0] == f"| linformer | 4096 | {floor * 1e3:.1f} | 1.40 | 1.90 | 1 | 1.50 | 2.50 | 0.5 |"
    cols = rows[1].strip("| ").split(" | ")  # the peer 2.89× both floors: 0.5 for both
    assert cols[4] == cols[7] == "2.89" and cols[5] == cols[8] == "0.5" and len(rows) == 2
    pairs = [line for line in text.splitlines() if line.startswith("| linformer | linformer")]
    # fwd 0.74 against 1 ✓, step 0.60 against 0.5 ✗, memory 0.60 and 0.60 against 0.5 ✗
    assert "| 0.74 ✓ |" in pairs[0] and pairs[0].count("| 0.60 ✗ |") == 3
    assert "| 0.60 ✗ |" in pairs[1]  # the targets applied above
    assert "| log_sparse |" not in text.split("## Time over the FLOP floor")[1]
    targets = [m[6] for m in peers.marks(_doc(cells)) if m[0] == "linformer" and m[1] == 4096]
    assert targets == [1, 0.5, 0.5, 0.5]  # fwd, step, and memory's, which has no floor


def test_report_gives_the_share_of_kernel_time():
    """Median over the cells at L >= 4096 of kernel / wall time, per side; absent in older runs."""
    def side(wall, kernel):
        return {**_side(wall, 9), "fwd_sys_s": kernel, "fwdbwd_sys_s": 3 * kernel, "fwd_faults": 100}
    cells = {"efficient/4096": {"ours": side(0.1, 0.01), "peer": side(0.2, 0.1)},  # 10 % and 50 %
             "linear/16384": {"ours": side(0.1, 0.03), "peer": side(0.2, 0.06)},  # 30 % and 30 %
             "linear/1024": {"ours": side(0.1, 0.09), "peer": side(0.1, 0.09)}}  # (too short: left out)
    assert "wall time, median over the cells at L ≥ 4096: 20% for ours and 40% for the peers" in (
        peers.report(_doc(cells)))
    assert "Kernel time" not in peers.report(_doc({"efficient/4096": {"ours": _side(0.1, 9)}}))
    merged = peers.merge([{"status": "ok", "fwd_s": [1, 2], "fwd_sys_s": [0.1, 0.3], "fwd_faults": [5, 7]},
                          {"status": "ok", "fwd_s": [3], "fwd_sys_s": [0.2], "fwd_faults": [9]}])
    assert (merged["fwd_sys_s"], merged["fwd_faults"]) == (0.2, 7)


def test_floor_counts_the_pairs_own_options():
    """nystrom runs with 256 landmarks (default 64) and local with window 768 (default 256):
    the floor that decides a target must count the work of those, not of the defaults."""
    doc = _doc({})
    rate = doc["machine"]["matmul_gflops"] * 1e9
    B, H, D, L = peers.B, peers.H, peers.D, 4096
    nystrom = attnzoo.get("nystrom")
    work = nystrom.flops(B, H, L, L, D, D, False, nystrom.options(num_landmarks=256))
    projections = 4 * 2.0 * B * L * peers.D_MODEL**2
    assert peers.floor_s(peers.PAIRS["nystrom"], L, doc) == pytest.approx((work + projections) / rate)
    local = attnzoo.get("local")
    work = local.flops(B, H, L, L, D, D, False, local.options(window=768))
    assert peers.floor_s(peers.PAIRS["local"], L, doc) == pytest.approx(work / rate)
    linformer = attnzoo.get("linformer")  # k and v projected on its 256 rows: E(X W) = (E X) W
    work = linformer.flops(B, H, L, L, D, D, False, linformer.options(proj_len=256))
    projections = 2 * 2.0 * B * (L + 256) * peers.D_MODEL**2
    assert peers.floor_s(peers.PAIRS["linformer"], L, doc) == pytest.approx((work + projections) / rate)


def test_floors_are_at_sdpas_rate_where_the_run_measured_it():
    """Issue 8 puts the floor at SDPA's rate of useful attention work; a run from before that
    was measured keeps its floors at the matmul rate. Targets follow: a peer at 1.9× the floor at
    SDPA's rate is 2.4× the one at the matmul rate (target 1.0 against 0.5)."""
    old, new = _doc({}), _doc({})
    new["machine"]["sdpa_gflops"] = 80.0  # matmul 100
    assert peers.floor_rate(old) == (100.0, "the matmul rate") and peers.floor_rate(new)[0] == 80.0
    for name in ("nystrom", "linformer", "full"):
        ratio = peers.floor_s(peers.PAIRS[name], 4096, new) / peers.floor_s(peers.PAIRS[name], 4096, old)
        assert ratio == pytest.approx(100.0 / 80.0)
    floor = peers.floor_s(peers.PAIRS["nystrom"], 4096, new)
    peer = _side(1.9 * floor, 200)
    assert peers.peer_target("nystrom", peer, 4096, new, "fwd_s") == 1.0
    assert peers.peer_target("nystrom", peer, 4096, old, "fwd_s") == 0.5


def test_report_says_which_marks_the_matmul_rate_would_change():
    """Under the floor's rate, the report quotes the issue's words, both rates, and each mark
    whose target the matmul rate would make another, met or missed under each; nothing of it
    for a run without SDPA's rate."""
    doc = _doc({})
    doc["machine"]["sdpa_gflops"] = 80.0
    floor = peers.floor_s(peers.PAIRS["nystrom"], 4096, doc)
    doc["cells"] = {  # the peer's forward 1.9× the floor here (target 1), 2.4× at the matmul rate
        "nystrom/4096": {"ours": _side(0.96 * floor, 40),
                         "peer": {**_side(1.9 * floor, 200), "fwdbwd_s": 90.0}},
    }
    text = peers.report(doc)
    section = text.split("### The floor's rate")[1].split("## Ours against the peer")[0]
    assert peers.FLOOR_WORDS in section and "80.0 GFLOP/s" in section and "100.0 GFLOP/s" in section
    assert "4 of 4 marked ratios meet their target." in text
    assert "and 3 of 4 would meet theirs:" in section
    line = next(line for line in section.splitlines() if line.startswith("- `nystrom`"))
    assert line == ("- `nystrom` at L = 4096, forward time: 0.505; target 1 here (the peer 1.90× its floor), "
                    "0.5 at the matmul rate (2.38×): met here, missed there")
    assert len([line for line in section.splitlines() if line.startswith("- ")]) == 1  # the step: 0.5 both
    doc["cells"]["nystrom/4096"]["peer"]["fwd_s"] = 3.0 * floor  # 0.5 under both rates
    assert "would make every floor 0.80× as long. No mark's target would change.\n" in peers.report(doc)
    doc["machine"].pop("sdpa_gflops")
    assert "### The floor's rate" not in peers.report(doc)


def test_sdpa_rate_is_useful_attention_work_over_the_median_call(monkeypatch):
    """4·B·H·L²·D FLOPs of SDPA's forward at SDPA_RATE_L over its median time, in GFLOP/s."""
    monkeypatch.setattr(peers, "SDPA_RATE_L", 32)
    calls = []
    monkeypatch.setattr(peers, "timings", lambda call, n: calls.append(call()) or [1e-6, 3e-6, 2e-6])
    expected = 4.0 * peers.B * peers.H * 32**2 * peers.D / 2e-6 / 1e9
    assert peers.sdpa_rate(2) == round(expected, 1)
    assert calls[0].shape == (peers.B, peers.H, 32, peers.D)


@pytest.mark.parametrize("pair", ["lsh", "lsh_causal"])
def test_shared_qk_pairs_run_lsh_with_shared_qk(pair):
    """k = q and the shared_qk option (normalised keys, self penalty), as the peer's shared QK."""
    p = peers.PAIRS[pair]
    got = peers.ours_case(p, 40).fwd()
    q, _, v = peers._qkv(40)
    options = {n: o for n, o in p.options.items()}

    def ours(shared_qk):
        return attnzoo.attention(q, q, v, mechanism="lsh", causal=p.causal, shared_qk=shared_qk,
                                 generator=torch.Generator().manual_seed(0), **options)
    torch.testing.assert_close(got, ours(True))
    assert not torch.allclose(got, ours(False))


def test_cheap_cells_get_more_rounds():
    quick, slow = {"child_s": 5.0}, {"child_s": peers.CHEAP_S + 1}
    assert peers.cell_rounds({"ours": [], "peer": []}, 2, 4) == 2  # nothing run yet
    assert peers.cell_rounds({"ours": [quick], "peer": [quick]}, 2, 4) == 4
    assert peers.cell_rounds({"ours": [quick], "peer": [slow]}, 2, 4) == 2  # one slow side: no more
    assert peers.cell_rounds({"ours": [quick]}, 3, 0) == 3  # --cheap-rounds off
    slow_runs = {"ours": [slow], "peer": [slow], "paired": [quick]}
    # SDPA on both sides: its ratio comes from the paired process, not from more rounds
    assert peers.job_rounds(("full", 16384), {("full", 16384): slow_runs}, 2, 4) == 2
    assert peers.job_rounds(("linformer", 16384), {("linformer", 16384): slow_runs}, 2, 4) == 2


def test_paired_calls_alternate_and_give_each_twos_ratio(monkeypatch):
    """measure_paired: a warm-up call of each side, then ours, peer, peer, ours, ...; the ratio of
    each adjacent two, forward then forward+backward; merge_paired takes their median."""
    events = []
    x = torch.ones(3, requires_grad=True)
    ours, peer = (peers.Case(lambda name=name: events.append(name) or x * 2, [x])
                  for name in ("ours", "peer"))
    # a call of ours takes 2 s, of the peer 1 s
    monkeypatch.setattr(peers, "timings", lambda fn, n: (fn(), [2.0 if events[-1] == "ours" else 1.0])[1])
    monkeypatch.setattr(peers, "calls_for", lambda first, repeats: 3)
    result = peers.measure_paired(ours, peer, repeats=3, backward=True)
    assert result == {"status": "ok", "fwd_ratios": [2.0] * 3, "fwdbwd_ratios": [2.0] * 3}
    assert events[:8] == ["ours", "peer", "ours", "peer", "peer", "ours", "ours", "peer"]
    assert x.grad is not None  # (the steps ran their backward)
    runs = [{"status": "ok", "fwd_ratios": [1.0, 1.2], "fwdbwd_ratios": [0.9]},
            {"status": "ok", "fwd_ratios": [1.1]}, {"status": "child failed"}]
    assert peers.merge_paired(runs) == {"status": "ok", "rounds": 2, "fwd_ratio": 1.1, "fwd_pairs": 3,
                                        "fwdbwd_ratio": 0.9, "fwdbwd_pairs": 1}


def test_report_takes_full_attentions_ratio_from_the_paired_calls():
    """Where a full cell has paired ratios, they are its time ratios (marked ‡) and its marks; the
    processes' medians (1.10 here) stay in the ms columns."""
    cell = {"ours": _side(4.4, 33), "peer": _side(4.0, 33),
            "paired": {"status": "ok", "rounds": 2, "fwd_ratio": 1.01, "fwdbwd_ratio": 1.06}}
    doc = {**_doc({"full/16384": cell}), "paired_full": True}
    text = peers.report(doc)
    row = next(line for line in text.splitlines() if line.startswith("| full | torch SDPA | 16384"))
    assert "1.01 ✓ ‡" in row and "1.06 ✗ ‡" in row and "1.10" not in row
    assert "training-step time against SDPA, the calls alternating in one process: 1.060" in text
    assert "Full attention's time ratios (‡)" in text


def test_memory_is_the_median_of_every_memory_call(monkeypatch):
    """Cheap calls are measured MEMORY_CALLS times a process, slow ones once; a cell's memory
    is the median over every call of every round."""
    readings = iter([3, 1, 9, 5, None])
    monkeypatch.setattr(peers, "peak_memory", lambda fn: next(readings))
    assert peers.peak_memories(None, first_s=0.5) == [3, 1, 9]
    assert peers.peak_memories(None, first_s=peers.MEMORY_CALL_S) == [5]
    assert peers.peak_memories(None, first_s=2.0) == []  # (/proc could not tell)
    runs = [{"status": "ok", "fwd_s": [0.1], "fwd_peak_bytes": [m * 2**20 for m in (9, 1, 1)]},
            {"status": "ok", "fwd_s": [0.2], "fwd_peak_bytes": [m * 2**20 for m in (5, 5, 5)]},
            {"status": "ok", "fwd_s": [0.3], "fwd_peak_bytes": []}]
    # the median of all six calls; the first call of each round would give 7, rounds' medians 3
    assert peers.merge(runs)["fwd_mib"] == 5.0


@pytest.mark.parametrize("part", ["time", "memory"])
def test_each_part_measures_after_a_warm_up(monkeypatch, part):
    """A process measures one part, forward then forward+backward, each after a warm-up call."""
    events = []
    monkeypatch.setattr(peers, "peak_memories", lambda fn, first_s: events.append("memory") or [])
    monkeypatch.setattr(peers, "timed_calls",
                        lambda fn, n, key: events.append("timed") or {f"{key}_s": [0.1]})
    x = torch.ones(3, requires_grad=True)
    case = peers.Case(lambda: events.append("call") or x * 2, [x])
    result = peers.measure_side(case, repeats=1, backward=True, part=part)
    assert result["bwd_status"] == "ok" and ("fwdbwd_s" in result) == (part == "time")
    done = "timed" if part == "time" else "memory"
    # warm-up, the part; the gradient's shape from a call; warm-up, the part with backward
    assert events == ["call", done, "call", "call", done]
    with pytest.raises(ValueError, match="part must be"):
        peers.measure_side(case, repeats=1, backward=False, part="both")


def test_rounds_are_interleaved_and_each_pass_is_written(tmp_path, monkeypatch):
    """Round r of every cell before round r + 1 of any; cheap cells' extra rounds after both;
    the report after each pass says it is partial, the last one not."""
    out, calls = tmp_path / "perf.md", []

    def fake_child(pair, side, L, args):
        calls.append((pair, L, side, out.read_text() if out.exists() else None))
        return {"status": "ok", "fwd_s": [0.1], "fwd_peak_bytes": [2**20],
                "child_s": 5.0 if L == 17 else 30.0}

    monkeypatch.setattr(peers, "run_child", fake_child)
    monkeypatch.setattr(peers, "machine", lambda threads: {**_doc({})["machine"], "sdpa_gflops": 80.0})
    rates = iter([130.0, 90.0, 120.0])  # measured after each pass
    monkeypatch.setattr(peers, "RATES", {"matmul_gflops": lambda threads: next(rates),
                                         "sdpa_gflops": lambda threads: 70.0})
    peers.main(["--only", "taylor", "--lengths", "17,19", "--rounds", "2", "--cheap-rounds", "3",
                "--out", str(out)])
    ours = [(pair, L, text) for pair, L, side, text in calls if side == "ours"]
    both = [("full", 17), ("full", 19), ("taylor", 17), ("taylor", 19)]
    # L = 17 is cheap; full (SDPA against SDPA) adds a paired process a round, no more rounds
    assert [c[:2] for c in ours] == both + both + [("full", 17), ("taylor", 17)]
    assert [(pair, L) for pair, L, side, _ in calls if side == "paired"] == [("full", 17), ("full", 19)] * 2 \
        + [("full", 17)]
    assert ours[0][2] is None and "Partial: written after pass 1 " in ours[4][2]
    assert "Partial: written after pass 2 " in ours[8][2] and "| taylor | no | 100 | 1.00 |" in ours[8][2]
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [doc["cells"][f"{n}/{L}"]["ours"]["rounds"] for n in ("taylor", "full") for L in (17, 19)] \
        == [3, 2, 3, 2]
    assert "(3 where every round of a side took under 25 s: " in out.read_text()
    assert doc["cells"]["full/19"]["paired"] == {"status": "ok", "rounds": 2}  # (the fake kept no ratios)
    assert doc["machine"]["matmul_gflops_measured"] == [100.0, 130.0, 90.0, 120.0]
    assert doc["machine"]["matmul_gflops"] == 110.0  # their median sets the floors
    assert "110.0 GFLOP/s (the median of 4 measurements" in out.read_text()
    assert doc["machine"]["sdpa_gflops_measured"] == [80.0, 70.0, 70.0, 70.0]  # (80 before the run)
    assert "SDPA's rate of useful attention work 70.0 GFLOP/s (the median of 4" in out.read_text()
    assert "Partial" not in out.read_text() and ", interleaved" in out.read_text()


def test_agreement_finds_the_same_and_different_outputs():
    """Pairs marked same_output are checked for it; a peer of another function is caught."""
    same = peers.agreement(peers.PAIRS["full_causal"], 33)
    assert same["status"] == "ok" and same["max_abs_diff"] <= 1e-6 < same["max_abs"]
    wrong = peers.Pair("full", False, peers.sdpa(True), "SDPA causal", "x", same_output=True)
    differ = peers.agreement(wrong, 33)
    assert differ["max_abs_diff"] > 0.01
    doc = _doc({"full/4096": {"ours": _side(0.3, 9), "peer": _side(0.3, 9)}})
    doc["agreement"] = {"full": same}
    assert "the same outputs, checked at L = 33" in peers.report(doc)
    doc["agreement"] = {"full": differ}
    assert "✗ the outputs differ" in peers.report(doc)
    scaled = dataclasses.replace(peers.PAIRS["full"], peer_factor=2.0)
    assert peers.agreement(scaled, 33)["max_abs_diff"] > 0.01  # the factor is applied


def test_agreement_checks_the_aligned_calls():
    """A pair with ``align`` is checked on the two calls it builds, not on the sides as measured
    (here it makes the causal "peer" of non-causal full attention non-causal), and a peer that
    is not installed is reported, not raised."""
    wrong = peers.Pair("full", False, peers.sdpa(True), "SDPA causal", "x", same_output=True)

    def align(pair, L):
        return peers.ours_case(pair, L).fwd, peers.sdpa(False)(L).fwd

    assert peers.agreement(dataclasses.replace(wrong, align=align), 33)["max_abs_diff"] <= 1e-6
    # the performer, linformer and nystrom checks need their peers (make peers)
    for name in ("performer", "linformer", "nystrom"):
        result = peers.agreement(peers.PAIRS[name], 33)
        assert result["status"] == "ok" or result["status"].startswith("not installed"), result


def test_the_nystrom_checks_peer_pinv_is_ours():
    """The nystrom check runs the peer's pseudo-inverse with each head's norms: that is
    attnzoo's iterative_pinv (its departure from the official one maximum over the batch)."""
    from attnzoo.mechanisms.nystrom import iterative_pinv

    a = torch.softmax(3 * torch.randn(2, 3, 17, 17, dtype=torch.float64), -1)
    a[1, 2] *= 4  # one matrix with larger norms: one maximum over the batch would move the others
    for iterations in (1, 6):  # (after one, the start's scale still shows)
        torch.testing.assert_close(peers._pinv_per_head(a, iterations), iterative_pinv(a, iterations))
