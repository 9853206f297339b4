#!/usr/bin/python3
"""bench/run.py's plan, statistics and generated README section, without running cai or
PyTorch."""
import argparse
import io
import json
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import run  # noqa: E402


def fake_run(pair, name, tokens, rss_mib, side="cai"):
    return {"pair": pair, "name": name, "side": side, "tokens_per_s": tokens,
            "peak_rss_bytes": rss_mib * run.MIB, "bytes_per_step": 400, "mfu": tokens / 1000,
            "overlap": 0.5 if side == "cai" else None,
            "bytes_basis": "measured" if side == "cai" else "analytic: 4Ψ"}


def result_of(runs, strategies, peers, refs):
    return {"command": "bench/run.py build --pairs 3", "date": "2026-12-03T12:00:00+00:00",
            "machine": {"nproc": 2, "cpu": "AMD EPYC", "os": "Debian GNU/Linux 12 (bookworm)"},
            "load_average": [1.0, 2.0], "blas": "/usr/lib/libopenblas.so", "size": "gpt2-tiny",
            "job": dict(run.SIZES["gpt2-tiny"], steps=12, precision="fp32", nproc=2),
            "psi": 842496, "pairs": 3, "strategies": strategies, "peers": peers,
            "sgemm": [{"peak_gflops": 61.25}, {"peak_gflops": 58.5}], "flops_per_token": 5842944,
            "notes": ["a note"], "plot": "plot.svg", "runs": runs,
            "summary": run.summarize(runs, strategies, peers, refs)}


class RunPyTest(unittest.TestCase):
    def test_Summary_IsMedianAndRangeOfPerPairRatios(self):
        runs = []
        for pair, (cai, torch) in enumerate(((100, 50), (90, 100), (120, 80))):
            runs += [fake_run(pair, "ddp", cai, 200), fake_run(pair, "torch-ddp", torch, 400,
                                                               "peer")]
        rows = run.summarize(runs, ["ddp"], ["torch-ddp"], {"ddp": "torch-ddp"})
        ddp, peer = rows
        self.assertEqual(ddp["ratio_tokens_per_s"], {"median": 1.5, "min": 0.9, "max": 2.0})
        self.assertEqual(ddp["tokens_per_s"], {"median": 100, "min": 90, "max": 120})
        self.assertEqual(ddp["ratio_peak_rss"]["median"], 0.5)
        self.assertIsNone(peer["reference"])
        self.assertNotIn("ratio_tokens_per_s", peer)

    def test_PairOrder_RotatesCandidatesAndRunsEachPeerOnceAfterItsFirstCandidate(self):
        strategies = ["ddp", "zero1", "fsdp"]
        refs = {"ddp": "torch-ddp", "zero1": "torch-zero", "fsdp": "torch-zero"}
        peers = ["torch-ddp", "torch-zero"]
        self.assertEqual(run.pair_order(0, strategies, peers, refs),
                         ["ddp", "torch-ddp", "zero1", "torch-zero", "fsdp"])
        self.assertEqual(run.pair_order(1, strategies, peers, refs),
                         ["zero1", "torch-zero", "fsdp", "ddp", "torch-ddp"])

    def test_Baseline_EachStrategyNextToItsRunOnTheOtherBuildWhichGoesFirstInOddPairs(self):
        args = argparse.Namespace(strategies="ddp,fsdp", peers=None, kind="gpt2",
                                  precision="bf16", baseline=Path("/tmp/before"),
                                  baseline_label="before")
        strategies, peers, refs, notes = run.plan(args)
        self.assertEqual(peers, [])
        self.assertEqual(refs, {"ddp": "ddp@baseline", "fsdp": "fsdp@baseline"})
        self.assertIn("baseline build (before", notes[0])
        self.assertEqual(run.pair_order(0, strategies, peers, refs),
                         ["ddp", "ddp@baseline", "fsdp", "fsdp@baseline"])
        self.assertEqual(run.pair_order(1, strategies, peers, refs),
                         ["fsdp@baseline", "fsdp", "ddp@baseline", "ddp"])
        self.assertEqual(run.on_baseline("fsdp:bucket=2@baseline"), ("fsdp:bucket=2", True))
        runs = []
        for pair, (after, before) in enumerate(((110, 100), (90, 100), (150, 100))):
            runs += [fake_run(pair, "ddp", after, 200), fake_run(pair, "ddp@baseline", before, 100)]
        result = result_of(runs, ["ddp", "ddp@baseline"], [], refs)
        after, before = result["summary"]
        self.assertEqual(after["reference"], "ddp@baseline")
        self.assertEqual(after["ratio_tokens_per_s"], {"median": 1.1, "min": 0.9, "max": 1.5})
        self.assertEqual(after["ratio_peak_rss"]["median"], 2.0)
        self.assertIsNone(before["reference"])
        # Its README section is its own, not the job's.
        result["baseline"] = {"build": "/tmp/before", "label": "before"}
        self.assertEqual(run.section(result), "gpt2-tiny fp32 against before")
        self.assertNotEqual(run.markers(result), run.markers(dict(result, baseline=None)))
        # So is a run given a section of its own, e.g. some strategies rerun.
        rerun = dict(result, baseline=None, section="gemini rows at abc123")
        self.assertEqual(run.section(rerun), "gpt2-tiny fp32 (gemini rows at abc123)")
        self.assertNotEqual(run.markers(rerun), run.markers(dict(rerun, section=None)))
        with self.assertRaises(SystemExit):
            with redirect_stderr(io.StringIO()):
                run.parse_args(["build", "--baseline-label", "x"])

    def test_Plan_LlamaOrBf16_DdpAndZeroPeersRunTheJobInBf16Autocast(self):
        for kind, precision in (("llama", "fp32"), ("gpt2", "bf16"), ("llama", "bf16")):
            args = argparse.Namespace(strategies="ddp,zero2,fsdp", peers=None, kind=kind,
                                      precision=precision)
            strategies, peers, refs, notes = run.plan(args)
            self.assertEqual(peers, ["torch-ddp", "torch-zero"])
            self.assertEqual(refs, {"ddp": "torch-ddp", "zero2": "torch-zero",
                                    "fsdp": "torch-zero"})
            self.assertEqual(any("torch.autocast" in n for n in notes), precision == "bf16")

    def test_Plan_PeerThatCannotRunTheJob_LeftOutWithWhyOrRefusedWhenNamed(self):
        args = argparse.Namespace(strategies="ddp,tp2", peers=None, kind="llama",
                                  precision="fp32")
        strategies, peers, refs, notes = run.plan(args)
        self.assertEqual(peers, ["torch-ddp"])
        self.assertEqual(refs, {"ddp": "torch-ddp", "tp2": "ddp"})
        self.assertIn("Not run: torch-tp implements gpt2 only, not llama", notes[0])
        args = argparse.Namespace(strategies="sp2", peers="torch-ulysses", kind="gpt2",
                                  precision="bf16")
        with self.assertRaises(SystemExit) as e:
            run.plan(args)
        self.assertIn("torch-ulysses trains in fp32 only, not bf16", str(e.exception.code))

    def test_UnknownNames_ExitWithNearestAndValidOnes(self):
        with self.assertRaises(SystemExit) as e:
            run.names("ddp,zero3", run.STRATEGIES, "strategy")
        self.assertIn("unknown strategy 'zero3'. did you mean 'zero2'?", e.exception.code)
        self.assertIn("valid: ddp, zero1, zero2, zero2-offload, fsdp", e.exception.code)
        with redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            run.parse_args(["build", "--size", "gpt2-3m"])

    def test_Variants_SetPluginKeysAndGetTheirOwnSection(self):
        self.assertEqual(run.strategy("zero2:reduce_bucket_size_in_m=48:overlap_communication=false"),
                         ("low_level_zero", "stage = 2\nreduce_bucket_size_in_m = 48\n"
                          "overlap_communication = false\n", "torch-zero"))
        self.assertEqual(run.strategy("ddp:train.cpu_caching_allocator=false:bucket_cap_mb=5"),
                         ("ddp", "bucket_cap_mb = 5\n", "torch-ddp"))
        self.assertEqual(run.job_sets("ddp:train.cpu_caching_allocator=false:bucket_cap_mb=5"),
                         ["train.cpu_caching_allocator=false"])
        chosen = run.names("ddp,ddp:bucket_cap_mb=100,zero2,zero2:stage=1", run.STRATEGIES,
                           "strategy")
        args = argparse.Namespace(strategies=",".join(chosen), peers="none", kind="gpt2",
                                  precision="fp32")
        strategies, peers, refs, notes = run.plan(args)
        self.assertEqual(refs, {"ddp": None, "ddp:bucket_cap_mb=100": "ddp", "zero2": "ddp",
                                "zero2:stage=1": "zero2"})
        result = result_of([fake_run(0, s, 1, 1) for s in strategies], strategies, [], refs)
        self.assertEqual(run.markers(result)[0],
                         "<!-- run.py:begin gpt2-tiny fp32 sweep of bucket_cap_mb,stage -->")
        for bad in ("ddp:bucket_cap_mb", "ddp:=3", "zero3:stage=1"):
            with self.assertRaises(SystemExit) as e:
                run.names(bad, run.STRATEGIES, "strategy")
            self.assertIn("BASE:key=value", e.exception.code)

    def test_SizeOptions_OverridePreset(self):
        args = run.parse_args(["build", "--size", "llama-100m", "--n-layer", "2"])
        self.assertEqual((args.kind, args.n_layer, args.n_kv_head), ("llama", 2, 4))

    def test_FlopsPerToken_IsSixPerMatmulParameterPlusAttention(self):
        # GPT-2's positions are only looked up (its token embedding is the head's matrix too);
        # Llama's token embedding is only looked up (its head is a matrix of its own).
        job = argparse.Namespace(**dict(run.SIZES["gpt2-tiny"], nproc=2))
        self.assertEqual(run.flops_per_token(job, 842496),
                         6 * (842496 - 128 * 128) + 12 * 4 * 128 * 128)
        llama = argparse.Namespace(**run.SIZES["llama-100m"])
        self.assertEqual(run.flops_per_token(llama, 99496704),
                         6 * (99496704 - 32000 * 768) + 12 * 8 * 768 * 256)
        self.assertEqual(run.shapes(job), {"ffn": 512, "qkv": 384})
        llama = argparse.Namespace(kind="llama", n_embd=768, n_head=12, n_kv_head=4)
        self.assertEqual(run.shapes(llama), {"ffn": 2048, "qkv": 768 + 2 * 256})

    def test_Params_MatchCaiModels(self):
        # 842,496: the peers' count for this job (bench/README.md); 557,696: cai's summary.json
        # (strategy_bytes params / 4 under ddp) for the Llama below.
        self.assertEqual(run.params(argparse.Namespace(**run.SIZES["gpt2-tiny"])), 842496)
        llama = argparse.Namespace(kind="llama", vocab_size=256, n_ctx=128, n_layer=2, n_head=4,
                                   n_kv_head=2, n_embd=128)
        self.assertEqual(run.params(llama), 557696)

    def test_Readme_SectionReplacedBetweenItsJobsMarkersOnly(self):
        runs = [fake_run(0, "ddp", 100, 200), fake_run(0, "torch-ddp", 50, 400, "peer")]
        result = result_of(runs, ["ddp"], ["torch-ddp"], {"ddp": "torch-ddp"})
        BEGIN, END = run.markers(result)
        other = "<!-- run.py:begin gpt2-30m fp32 -->\nkept\n<!-- run.py:end gpt2-30m fp32 -->"
        with tempfile.TemporaryDirectory() as tmp:
            readme = Path(tmp) / "README.md"
            readme.write_text(f"before\n{BEGIN}\nold\n{END}\n{other}\nafter\n")
            results = Path(tmp) / "results" / "results.json"
            results.parent.mkdir()
            results.write_text(json.dumps(result))
            saved, run.README = run.README, readme
            try:
                with redirect_stdout(io.StringIO()):
                    run.write_readme(results)
                    once = readme.read_text()
                    run.write_readme(results)
            finally:
                run.README = saved
            self.assertEqual(readme.read_text(), once)
        self.assertTrue(once.startswith(f"before\n{BEGIN}\n### gpt2-tiny, fp32\n"))
        self.assertTrue(once.endswith(f"{END}\n{other}\nafter\n"))
        self.assertNotIn("old", once)
        for needed in ("`bench/run.py build --pairs 3`", "2026-12-03", "/usr/lib/libopenblas.so",
                       "2 CPUs (AMD EPYC)", "Ψ = 842,496", "2.000 (2.000-2.000)", "a note",
                       "](results/plot.svg)", "61.2, 58.5 GFLOP/s", "5,842,944 FLOPs/token",
                       " 10.0% "):
            self.assertIn(needed, once)

    def test_Readme_NewJob_SectionAddedWhereTheNewMarkerStands(self):
        result = result_of([fake_run(0, "ddp", 1, 1)], ["ddp"], [], {"ddp": None})
        with tempfile.TemporaryDirectory() as tmp:
            readme = Path(tmp) / "README.md"
            readme.write_text(f"before\n{run.NEW}\nafter\n")
            results = Path(tmp) / "results.json"
            results.write_text(json.dumps(result))
            saved, run.README = run.README, readme
            try:
                with redirect_stdout(io.StringIO()):
                    run.write_readme(results)
            finally:
                run.README = saved
            text = readme.read_text()
        BEGIN, END = run.markers(result)
        self.assertTrue(text.startswith(f"before\n{BEGIN}\n"))
        self.assertTrue(text.endswith(f"{END}\n\n{run.NEW}\nafter\n"))

    def test_Readme_WithoutMarkers_ExitsSayingWhatToAdd(self):
        with tempfile.TemporaryDirectory() as tmp:
            readme = Path(tmp) / "README.md"
            readme.write_text("no markers\n")
            results = Path(tmp) / "results.json"
            results.write_text(json.dumps(result_of([fake_run(0, "ddp", 1, 1)], ["ddp"], [],
                                                    {"ddp": None})))
            saved, run.README = run.README, readme
            try:
                with self.assertRaises(SystemExit) as e:
                    run.write_readme(results)
            finally:
                run.README = saved
        self.assertIn(run.NEW, e.exception.code)


if __name__ == "__main__":
    unittest.main()
