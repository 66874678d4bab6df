"""A bystander for the hostile-client tests: trains a small GPT through the daemon one
step per "step" line on stdin (answering "ok <n>"), and on "done" prints the SHA-256 of
its weights and of its optimizer state_dict, then exits. Everything is seeded and
single-threaded, so two runs of the same number of steps give the same bytes, whatever
else the daemon is doing at the time (that is what the tests check)."""
import hashlib
import sys

import torch

import trainstream
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k in sorted(st):
            v = st[k]
            if torch.is_tensor(v):
                h.update(f"{pid}.{k}".encode())
                h.update(v.detach().float().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(socket: str, steps: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    model, opt = trainstream.wrap(model, socket=socket, lr=1e-3, job="bystander")
    batches = text_batches(corpus(), cfg, batch=4, steps=steps, seed=1)
    print("ready", flush=True)
    done = 0
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            x, y = batches[done]
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            print(f"ok {done}", flush=True)
        elif cmd == "done":
            print(f"digest {done} {digest(model, opt)}", flush=True)
            return


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
