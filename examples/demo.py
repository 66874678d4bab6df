"""`make demo`: start a daemon, train a small GPT through it beside plain torch AdamW,
print both losses per step, then show `trainstreamctl status` while attached."""
import copy
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches  # noqa: E402

import trainstream  # noqa: E402
from trainstream._native import daemon as _daemon  # noqa: E402


def main() -> int:
    build = os.environ.get("TRAINSTREAM_BUILD_DIR", os.path.join(HERE, "..", "build"))
    bin_dir = os.path.join(build, "bin")
    tmp = tempfile.mkdtemp(prefix="trainstream-demo-")
    socket = os.path.join(tmp, "trainstreamd.sock")
    daemon = subprocess.Popen([os.path.join(bin_dir, "trainstreamd"), "--foreground",
                               "--socket", socket, "--log-level", "warn"])
    try:
        deadline = time.monotonic() + 10
        while True:  # wait for readiness, no fixed sleep
            try:
                print("daemon:", _daemon.connect(socket, spawn=False).ping())
                break
            except trainstream.DaemonError:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise
                time.sleep(0.02)
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128)
        ref = TinyGPT(cfg)
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                      socket=socket, job="demo")
        print(f"\n{'step':>4} {'torch AdamW':>12} {'TrainStream':>12} {'rel diff':>9}")
        for step, (x, y) in enumerate(text_batches(corpus(), cfg, batch=8, steps=20), 1):
            losses = []
            for m, o in ((ref, ref_opt), (model, opt)):
                loss = m(x, y)
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            print(f"{step:>4} {losses[0]:>12.6f} {losses[1]:>12.6f} "
                  f"{abs(losses[0] - losses[1]) / abs(losses[0]):>9.1e}")
        print("\n$ trainstreamctl status")
        sys.stdout.flush()
        subprocess.run([os.path.join(bin_dir, "trainstreamctl"), "--socket", socket, "status"],
                       check=True)
        trainstream.unwrap(model)
        return 0
    finally:
        # A plain stop would keep an attached session's state for a next daemon on this
        # socket (docs/recovery.md, "Stops and restarts"); the demo's socket has none.
        subprocess.run([os.path.join(bin_dir, "trainstreamctl"), "--socket", socket,
                        "shutdown", "--discard-state"], capture_output=True, timeout=10)
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


if __name__ == "__main__":
    sys.exit(main())
