"""How each library trains a scenario, written the way its users write it.

Every engine loads the scenario's checkpoint (``from_pretrained``, or TrainStream's
``load_model``), adds the same LoRA adapters for a LoRA scenario (PEFT, or Unsloth's own
``get_peft_model``), and returns a ``Run`` whose ``step()`` is one training step of the
shared loop: forward with the model's own causal-LM loss (labels = inputs), backward,
AdamW step (lr from the scenario, betas (0.9, 0.999), eps 1e-8, weight decay 0.01),
gradients dropped. Mixed precision is bf16 the way each library does it: torch
autocast for stock, torchao, bitsandbytes, Unsloth and TrainStream; FSDP2's
``MixedPrecisionPolicy``; DeepSpeed's ``bf16`` section.

An engine names the packages it imports (``needs``): compare.py reports "not installed"
with the ImportError when one is missing, and "needs CUDA" for an engine that cannot run
without a GPU (torchao's offload optimizer, Unsloth, TrainStream's GPU optimizer), before
any setup. The others also run on a CPU at --tiny (FSDP2, DeepSpeed and bitsandbytes
were checked so on the CPU machine): meaningless as figures, but the same code.
"""
from __future__ import annotations

import json
import os
import socket as _socket
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from .measure import fp8_copies_checked, matmul_paths
from .scenarios import LORA, Scenario

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.01


@dataclass
class Context:
    scenario: Scenario
    tiny: bool
    ckpt: str
    cuda: bool
    cap_bytes: Optional[int]     # the VRAM cap (None: uncapped)
    socket: Optional[str]        # this engine's TrainStream daemon (TrainStream engines)
    ids: Any = None              # the batch, on the device

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"


@dataclass
class Run:
    step: Callable[[], Any]                  # one training step; returns the loss
    trained_params: int
    adapting: Callable[[], bool] = lambda: False
    report: Callable[[], Dict[str, Any]] = dict   # what the engine decided, after the run
    info: Dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    held: list = field(default_factory=list)      # objects that must outlive the run


@dataclass(frozen=True)
class Engine:
    name: str
    label: str
    kinds: Tuple[str, ...]       # the scenario kinds it runs: "full", "lora"
    needs: Tuple[str, ...]       # modules it imports, checked first
    needs_cuda: bool
    setup: Callable[[Context], Run]
    trainstream: bool = False    # a TrainStream engine (gets a daemon of its own)


# ----------------------------------------------------------------- shared pieces
def _torch():
    import torch
    return torch


def _load(ctx: Context, on_device: bool, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` of the checkpoint in the scenario's
    dtype, straight onto the GPU when ``on_device`` (device_map), else in host memory."""
    torch = _torch()
    from transformers import AutoModelForCausalLM
    dtype = getattr(torch, ctx.scenario.param_dtype if ctx.scenario.kind == "full" else "bfloat16")
    if on_device and ctx.cuda:
        kwargs.setdefault("device_map", {"": 0})
    model = AutoModelForCausalLM.from_pretrained(ctx.ckpt, dtype=dtype, attn_implementation="sdpa",
                                                 **kwargs)
    model.config.use_cache = False
    # from_pretrained returns the model in eval mode, where transformers skips gradient
    # checkpointing: every engine trains in train mode, as Trainer and its users do.
    model.train()
    return model


def _lora(model):
    import peft
    return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))


def _checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _trained(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _adamw(params, lr: float, on_cuda: bool):
    """torch's AdamW, fused (on the GPU, or on the CPU where torch has the fused CPU
    kernel), else foreach."""
    torch = _torch()
    try:
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                 fused=True)
    except (RuntimeError, ValueError):
        if on_cuda:
            raise
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                 foreach=True)


def _loop(model, opt, ctx: Context, autocast: bool = True) -> Callable[[], Any]:
    torch = _torch()

    def step():
        with torch.autocast(ctx.device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ctx.ids, labels=ctx.ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _free_port() -> int:
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_group(cuda: bool) -> None:
    """torch.distributed with one rank on this machine (FSDP2 and DeepSpeed need one)."""
    torch = _torch()
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    if cuda:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


# ----------------------------------------------------------------- stock PyTorch
def _stock(checkpointing: bool):
    def setup(ctx: Context) -> Run:
        model = _load(ctx, on_device=True)
        if ctx.scenario.kind == "lora":
            model = _lora(model)
        if checkpointing:
            _checkpointing(model)
        model.to(ctx.device)
        params = _trained(model)
        opt = _adamw(params, ctx.scenario.lr, ctx.cuda)
        return Run(_loop(model, opt, ctx), _numel(params),
                   info={"optimizer": "fused" if opt.defaults.get("fused") else "foreach"})
    return setup


# ----------------------------------------------------------------- FSDP2 + CPU offload
def _decoder_layers(model) -> list:
    """The decoder layers, found the way FSDP users find them: the module classes the
    model names in ``_no_split_modules`` (what accelerate's FSDP auto-wrap wraps)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"{type(base).__name__} names no layer classes in _no_split_modules "
                           f"({sorted(names)}): nothing for FSDP2 to shard per layer")
    return layers


def _fsdp2(ctx: Context) -> Run:
    torch = _torch()
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    _single_process_group(ctx.cuda)
    model = _load(ctx, on_device=False)
    if ctx.scenario.kind == "lora":
        model = _lora(model)
    params_before = _numel(_trained(model))
    policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=ctx.cuda),  # pinned on a GPU host
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32))
    for layer in _decoder_layers(model):
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    # The sharded parameters live in host memory: the optimizer steps there.
    opt = _adamw(_trained(model), ctx.scenario.lr, on_cuda=False)

    import torch.distributed as dist
    return Run(_loop(model, opt, ctx, autocast=False), params_before,
               info={"optimizer": "fused" if opt.defaults.get("fused") else "foreach"},
               close=dist.destroy_process_group)


# ----------------------------------------------------------------- torchao
def _torchao(checkpointing: bool):
    def setup(ctx: Context) -> Run:
        torch = _torch()
        from torchao.optim import CPUOffloadOptimizer
        model = _load(ctx, on_device=True)
        if ctx.scenario.kind == "lora":
            model = _lora(model)
        if checkpointing:
            _checkpointing(model)
        params = _trained(model)
        opt = CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, fused=True,
                                  lr=ctx.scenario.lr, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
        return Run(_loop(model, opt, ctx), _numel(params))
    return setup


# ----------------------------------------------------------------- DeepSpeed
def deepspeed_config(ctx: Context, stage: int) -> Dict[str, Any]:
    """The JSON config: ZeRO ``stage`` with the optimizer (and for stage 3 the
    parameters too: on one GPU, ZeRO-3 differs from ZeRO-2 only by offloading them) in
    pinned host memory, bf16, AdamW with the shared hyper-parameters."""
    batch, _ = ctx.scenario.tokens(ctx.tiny)
    zero: Dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": ctx.scenario.lr, "betas": list(BETAS),
                                                      "eps": EPS, "weight_decay": WEIGHT_DECAY}},
            "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _deepspeed(stage: int, checkpointing: bool):
    def setup(ctx: Context) -> Run:
        import deepspeed
        _single_process_group(ctx.cuda)
        config = deepspeed_config(ctx, stage)
        path = os.path.join(tempfile.mkdtemp(prefix="compare-ds-"), "ds_config.json")
        with open(path, "w") as f:
            json.dump(config, f, indent=1)
        keep = []
        if stage == 3:
            # HF's ZeRO-3 integration: from_pretrained loads the weights partitioned
            # (and offloaded) instead of whole, as its users get it.
            from transformers.integrations import HfDeepSpeedConfig
            keep.append(HfDeepSpeedConfig(path))
        model = _load(ctx, on_device=False)
        if ctx.scenario.kind == "lora":
            model = _lora(model)
        if checkpointing:
            _checkpointing(model)
        params = _trained(model)
        count = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=path)

        def step():
            loss = engine(input_ids=ctx.ids, labels=ctx.ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            return loss
        # The HF config must outlive the run.
        return Run(step, count, info={"deepspeed_config": config}, held=keep)
    return setup


# ----------------------------------------------------------------- bitsandbytes QLoRA
def _bnb(checkpointing: bool):
    def setup(ctx: Context) -> Run:
        torch = _torch()
        import peft
        from transformers import BitsAndBytesConfig
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = _load(ctx, on_device=True, quantization_config=quant)
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model = _lora(model)
        params = _trained(model)
        opt = _adamw(params, ctx.scenario.lr, ctx.cuda)
        return Run(_loop(model, opt, ctx), _numel(params))
    return setup


# ----------------------------------------------------------------- Unsloth
def _unsloth(ctx: Context) -> Run:
    torch = _torch()
    from unsloth import FastLanguageModel
    _, seq = ctx.scenario.tokens(ctx.tiny)
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=ctx.ckpt, max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=True)
    model = FastLanguageModel.get_peft_model(
        model, r=LORA["r"], lora_alpha=LORA["lora_alpha"], lora_dropout=LORA["lora_dropout"],
        target_modules=LORA["target_modules"], bias="none", use_gradient_checkpointing="unsloth",
        random_state=0)
    model.train()
    params = _trained(model)
    opt = _adamw(params, ctx.scenario.lr, ctx.cuda)
    return Run(_loop(model, opt, ctx), _numel(params), info={"checkpointing": "unsloth"})


# ----------------------------------------------------------------- TrainStream
def _trainstream(quantize: Optional[str] = None, checkpointing: bool = False,
                 **options: Any):
    """``quantize``: None (a bf16 or fp32 ``from_pretrained`` model and wrap()'s own
    choices, quantize="auto" among them) or a format, read by ``load_model(quantize=)``
    as its users load a quantized base; ``options``: more wrap() options."""
    def setup(ctx: Context) -> Run:
        torch = _torch()
        import trainstream
        opts = dict(socket=ctx.socket, job="compare", **options)
        if ctx.cuda:
            opts.update(device="cuda", vram_limit=ctx.cap_bytes)
        if quantize is None:
            model = _load(ctx, on_device=False)
        else:
            from trainstream.integrations.huggingface import load_model
            model = load_model(ctx.ckpt, quantize=quantize, socket=ctx.socket)
            model.config.use_cache = False
            model.train()
        if ctx.scenario.kind == "lora":
            model = _lora(model)
        if checkpointing:
            _checkpointing(model)
        params = _trained(model)
        opt = torch.optim.AdamW(params, lr=ctx.scenario.lr, betas=BETAS, eps=EPS,
                                weight_decay=WEIGHT_DECAY)
        model, opt = trainstream.wrap(model, opt, **opts)  # AdamW becomes OffloadAdamW
        session = model._trainstream_session

        def report() -> Dict[str, Any]:
            rep = trainstream.memory_report(model)
            plan = rep.get("plan") or {}
            # Where the daemon's shared memory went (the host column counts all of it):
            # the regions this optimizer maps, by purpose (staging, gpu-optimizer-state,
            # activations, ...), and memory_report's categories.
            regions: Dict[str, int] = {}
            for r in opt.regions():
                purpose = r.get("purpose", "?")
                regions[purpose] = regions.get(purpose, 0) + int(r.get("bytes", 0))
            acts = rep.get("activations") or {}
            return {"optimizer_mode": opt.optimizer_mode,
                    "matmul_paths": matmul_paths(model),
                    "fp8_copies": fp8_copies_checked(model),
                    "regions_by_purpose": regions,
                    "host_by_category": (rep.get("host_per_param") or {}).get("bytes"),
                    "activation_host_capacity": acts.get("host_capacity_bytes"),
                    "plan": {k: plan.get(k) for k in ("quantize", "moment_dtype", "paged_blocks",
                                                      "usable_vram")},
                    "activation_policy": (rep.get("activations") or {}).get("policy"),
                    "events": [{k: v for k, v in e.items() if k != "time"}
                               for e in rep.get("events", []) if e.get("kind") in ("plan", "watchdog")][-12:]}
        return Run(_loop(model, opt, ctx), _numel(params), adapting=lambda: session.adapting,
                   report=report,
                   info={"wrap_options": {k: v for k, v in opts.items() if k != "socket"},
                         "base": f"load_model(quantize={quantize!r})" if quantize else "from_pretrained"})
    return setup


_BOTH, _LORA, _FULL = ("full", "lora"), ("lora",), ("full",)
ENGINES: Dict[str, Engine] = {e.name: e for e in (
    Engine("stock", "Stock PyTorch, fused AdamW", _BOTH, ("transformers",), False, _stock(False)),
    Engine("stock_ckpt", "Stock PyTorch + activation checkpointing", _BOTH, ("transformers",), False,
           _stock(True)),
    Engine("fsdp2_offload", "FSDP2 + CPUOffloadPolicy (1 process)", _BOTH,
           ("torch.distributed.fsdp",), False, _fsdp2),
    Engine("torchao_offload", "torchao CPUOffloadOptimizer (offload_gradients)", _BOTH,
           ("torchao.optim",), True, _torchao(False)),
    Engine("torchao_offload_ckpt", "torchao CPUOffloadOptimizer + checkpointing", _BOTH,
           ("torchao.optim",), True, _torchao(True)),
    Engine("deepspeed_zero2", "DeepSpeed ZeRO-2, CPU optimizer offload", _BOTH, ("deepspeed",), False,
           _deepspeed(2, False)),
    Engine("deepspeed_zero2_ckpt", "DeepSpeed ZeRO-2, CPU optimizer offload + checkpointing", _BOTH,
           ("deepspeed",), False, _deepspeed(2, True)),
    Engine("deepspeed_zero3", "DeepSpeed ZeRO-3, CPU optimizer + parameter offload", _BOTH,
           ("deepspeed",), False, _deepspeed(3, False)),
    Engine("bnb_qlora", "bitsandbytes QLoRA (NF4) + PEFT", _LORA, ("bitsandbytes", "peft"), False,
           _bnb(False)),
    Engine("bnb_qlora_ckpt", "bitsandbytes QLoRA (NF4) + PEFT + checkpointing", _LORA,
           ("bitsandbytes", "peft"), False, _bnb(True)),
    Engine("unsloth", "Unsloth (4-bit)", _LORA, ("unsloth",), True, _unsloth),
    Engine("trainstream", "TrainStream (auto)", _BOTH, ("trainstream",), False, _trainstream(),
           trainstream=True),
    Engine("trainstream_ckpt", "TrainStream (auto) + checkpointing", _BOTH, ("trainstream",), False,
           _trainstream(checkpointing=True), trainstream=True),
    Engine("trainstream_gpu_bf16", "TrainStream, optimizer_mode='gpu', bf16 moments", _FULL,
           ("trainstream",), True,
           _trainstream(optimizer_mode="gpu", moment_dtype="bfloat16"), trainstream=True),
    *(Engine(f"trainstream_{fmt}", f"TrainStream, {fmt.upper()} base (load_model)", _LORA,
             ("trainstream", "peft"), False, _trainstream(quantize=fmt), trainstream=True)
      for fmt in ("int8", "nf4", "fp8", "nvfp4")),
)}


def parse_engines(text: str, flag: str = "--engines"):
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names:
        raise ValueError(f"{flag} {text!r}: unknown {', '.join(map(repr, bad)) or '(none given)'}; "
                         f"accepted: all, or a comma-separated list of {', '.join(ENGINES)}")
    return [ENGINES[n] for n in names]
