#!/usr/bin/env python3
"""Writes the seed inputs of the control_request fuzz target into
corpus/control_request/seed-*: one selector byte (control_request_fuzz.cc) and
a trainstream.v1 message, encoded from the text below by `protoc --encode`.
Re-run after changing the seeds or the proto; libFuzzer's own finds sit beside
them under their SHA-1 names (scripts/fuzz.sh)."""
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROTO = "trainstream/v1/control.proto"

REGISTER = 0   # selector % 3 == 0; selector // 3 % 64 + 1 gradient slots
ATTACH = 1
LOAD_BASE = 2

HYPER = "groups { lr: 0.001 beta1: 0.9 beta2: 0.999 eps: 1e-8 weight_decay: 0.01 }"

SEEDS = {
    "register-one": (REGISTER, "RegisterParametersRequest",
                     HYPER + ' params { param_id: 1 name: "w" shape: [4, 8] dtype: DTYPE_FLOAT32 }'),
    "register-mixed": (REGISTER, "RegisterParametersRequest",
                       HYPER + " " + HYPER + " moment_dtype: DTYPE_BFLOAT16 max_grad_norm: 1.0"
                       ' params { param_id: 1 name: "a" shape: [3] dtype: DTYPE_BFLOAT16 }'
                       ' params { param_id: 7 name: "b" shape: [5, 1, 9] dtype: DTYPE_FLOAT16'
                       " grad_dtype: DTYPE_FLOAT32 group: 1 }"),
    "register-group-8-slots": (3 * 7, "RegisterParametersRequest",
                               HYPER + ' params { param_id: 2 name: "g" shape: [1000]'
                               " dtype: DTYPE_BFLOAT16 }"),
    "register-big-shape": (REGISTER, "RegisterParametersRequest",
                           HYPER + ' params { param_id: 3 name: "big" shape: [65536, 1048576]'
                           " dtype: DTYPE_FLOAT32 }"),
    "register-bad-group": (REGISTER, "RegisterParametersRequest",
                           HYPER + ' params { param_id: 1 name: "w" shape: [4] dtype: DTYPE_FLOAT32'
                           " group: 5 }"),
    "attach-group": (ATTACH, "AttachRequest",
                     'protocol_version: 1 pid: 1 job: "j" rank: 0 local_rank: 0 group {'
                     ' key: "run-1" local_rank: 1 local_world_size: 2 node_rank: 0 nnodes: 1'
                     " world_size: 2 timeout_s: 30 }"),
    "attach-bad-rank": (ATTACH, "AttachRequest",
                        'group { key: "k" local_rank: 3 local_world_size: 2 nnodes: 1'
                        " world_size: 2 }"),
    "load-base-nf4": (LOAD_BASE, "LoadBaseRequest",
                      'path: "/models/m/model.safetensors" format: "nf4" block_size: 64'
                      " session_id: 4095"),
    "load-base-int8": (LOAD_BASE, "LoadBaseRequest",
                       'path: "model.layers.3.mlp.up_proj.weight" format: "int8" block_size: 32'
                       " session_id: 1"),
    "load-base-nvfp4": (LOAD_BASE, "LoadBaseRequest",
                        'path: "/m" format: "nvfp4" session_id: 1099511627775'),
    "load-base-fp8": (LOAD_BASE, "LoadBaseRequest", 'path: "/m" format: "fp8" block_size: 7'),
    "load-base-none": (LOAD_BASE, "LoadBaseRequest", 'path: "/m" format: "none"'),
    "load-base-bad-format": (LOAD_BASE, "LoadBaseRequest", 'path: "/m" format: "q3"'),
}


def main() -> int:
    out_dir = HERE / "corpus" / "control_request"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, (selector, message, text) in SEEDS.items():
        encoded = subprocess.run(
            ["protoc", f"--proto_path={REPO / 'proto'}", f"--encode=trainstream.v1.{message}", PROTO],
            input=text.encode(), capture_output=True, check=False)
        if encoded.returncode != 0:
            sys.stderr.write(f"{name}: protoc --encode failed:\n{encoded.stderr.decode()}")
            return 1
        (out_dir / f"seed-{name}").write_bytes(bytes([selector]) + encoded.stdout)
    print(f"wrote {len(SEEDS)} seeds to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
