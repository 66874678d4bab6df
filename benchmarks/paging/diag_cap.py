"""Diagnostic, not a test: the CUDA cap test's scenario (test_paging_cuda.py, an
8-block 768-wide TinyGPT under a small VRAM cap) with the allocator's history recorded.
Writes $OUT/cap.pickle (torch.cuda.memory._dump_snapshot; read it with
torch.cuda._memory_viz or by replaying its device_traces) and $OUT/cap-events.json.

    STAGES="lean capdiag" scripts/gpu-check.sh     # or, with the build's environment:
    python benchmarks/paging/diag_cap.py --cap-mib 384 --held-mib 78
"""
import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
sys.path.insert(0, HERE)
import torch  # noqa: E402

import trainstream  # noqa: E402
from bench_paging import start_daemon  # noqa: E402
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap-mib", type=int, default=512, help="cap above what is held (MiB)")
    ap.add_argument("--held-mib", type=int, default=78,
                    help="device memory held first, as earlier tests in one process do (MiB)")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    out = os.environ.get("OUT", ".")
    proc, sock, cleanup = start_daemon("2G")
    torch.backends.cuda.matmul.allow_tf32 = False
    held = torch.empty(args.held_mib << 20, dtype=torch.uint8, device="cuda")
    torch.manual_seed(2)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=8, n_head=4, n_embd=768)
    model = TinyGPT(cfg)
    torch.cuda.memory._record_memory_history(max_entries=40000)
    limit = torch.cuda.memory_allocated() + (args.cap_mib << 20)
    model, opt = trainstream.wrap(model, socket=sock, device="cuda", vram_limit=limit,
                                  min_offload_bytes=1 << 16)
    session = model._trainstream_session
    print("plan", json.dumps(session.plan.as_dict(), default=str))
    rc, step = 0, -1
    try:
        for step, (x, y) in enumerate(text_batches(corpus(), cfg, batch=16, steps=args.steps,
                                                   seed=2)):
            torch.cuda.reset_peak_memory_stats()
            loss = model(x.cuda(), y.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {step}: peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, "
                  f"reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB, "
                  f"adapting {session.adapting}", flush=True)
    except torch.OutOfMemoryError as e:
        print(f"out of memory at step {step}: {str(e)[:400]}", flush=True)
        rc = 1
    finally:
        torch.cuda.memory._dump_snapshot(os.path.join(out, "cap.pickle"))
        with open(os.path.join(out, "cap-events.json"), "w") as f:
            json.dump(trainstream.memory_report(model)["events"], f, indent=1, default=str)
        proc.terminate()
        proc.wait(timeout=30)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
    del held
    return rc


if __name__ == "__main__":
    sys.exit(main())
