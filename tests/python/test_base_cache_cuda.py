"""GPU checks of the shared base: a base mapping registers with CUDA read-only
(cudaHostRegisterReadOnly) and copies to the GPU byte for byte; a load_model
model over an NF4 base runs on the GPU and matches its CPU forward."""
import pytest
import torch

from safetensors_writer import write_qwen_folder, write_safetensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_base_mapping_registers_read_only_and_copies_to_gpu(daemon, tmp_path):
    from trainstream.frozen.shared_base import load_base
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(2048, 1024, generator=g).bfloat16()
               for i in range(4)}
    write_safetensors(tmp_path / "m.safetensors", tensors)
    base = load_base(str(tmp_path), socket=daemon.socket, register_cuda=True)
    try:
        assert base.cuda_registered
        for name, t in tensors.items():
            v = base.tensor(name)
            assert v.is_pinned()  # registered memory: DMA copies
            assert torch.equal(v.to("cuda", non_blocking=True).cpu(), t)
    finally:
        base.release()
    assert not base.cuda_registered


def test_nf4_model_over_the_base_runs_on_gpu(daemon, tmp_path):
    pytest.importorskip("transformers")
    from trainstream.integrations.huggingface import load_model
    write_qwen_folder(tmp_path)
    model = load_model(str(tmp_path), quantize="nf4", socket=daemon.socket)
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        cpu = model(tokens).logits.float()
        gpu = model.to("cuda")(tokens.cuda()).logits.float().cpu()
    assert torch.allclose(cpu, gpu, rtol=5e-2, atol=5e-2), (cpu - gpu).abs().max()
    model.trainstream_base.release()
