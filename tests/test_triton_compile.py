"""The decode-attention Triton kernels compiled ahead of time for Hopper (sm_90) on the CPU:
the code paths the interpreter never takes (programmatic dependent launch, the L2-prefetch
PTX) and Triton's type rules, which the interpreter does not enforce (session 18: a variable
reused with another type in the paged kernel's PDL branch compiled in the interpreter and
failed on the GPU). Needs Triton's NVIDIA backend (ptxas ships in the wheel), not a GPU."""
import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KNew": "*bf16", "VNew": "*bf16",
            "Tables": "*i32", "Lens": "*i32", "Slots": "*i64", "SlotMap": "*i64", "Rows": "*i64",
            "Out": "*fp32", "Lse": "*fp32", "Cos": "*fp32", "Sin": "*fp32"}
SCALARS = {"sm_scale": "fp32", "max_len": "i32", "max_k": "i32", "softcap": "fp32",
           "window": "i32"}


def _compile(fn, constexprs: dict, pointers: dict | None = None):
    sig, pointers = {}, dict(POINTERS, **(pointers or {}))
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in SCALARS or name.startswith("stride"):
            sig[name] = SCALARS.get(name, "i32")
        else:
            raise AssertionError(f"argument {name} has no type here")
    try:
        return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=3))
    except RuntimeError as e:          # no NVIDIA toolchain in this Triton build
        if "ptxas" in str(e) or "backend" in str(e).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {e}")
        raise


COMMON = dict(GROUP=7, BLOCK_G=8, HEAD_DIM=64, BLOCK_N=64, SPLIT_LEN=1024, NUM_SPLITS=2,
              PRECISION="tf32", PREFETCH_KEYS=128)


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("new_token", [True, False])
def test_paged_decode_kernel_compiles_for_hopper(pdl, new_token):
    from hybridengine.kernels import paged_decode_attention as paged
    common = {key: value for key, value in COMMON.items() if key != "SPLIT_LEN"}
    # the fused form's Lens: the position state by row id (int64); the plain one's seq_lens
    k = _compile(paged._paged_split_kernel,
                 dict(common, BLOCK_SIZE=16, NEW_TOKEN=new_token, PDL=pdl),
                 {"Lens": "*i64" if new_token else "*i32"})
    ptx = k.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert ("prefetch.global.L2" in ptx) == pdl


@pytest.mark.parametrize("spec", [False, True])
def test_static_decode_kernel_compiles_for_hopper(spec):
    """spec: Gemma's soft-cap and sliding window on (their branches, head_dim 256's tile)."""
    from hybridengine.kernels import decode_attention
    shape = dict(HEAD_DIM=256, BLOCK_N=32) if spec else {}
    k = _compile(decode_attention._split_kernel,
                 dict(COMMON, NEW_TOKEN=True, PDL=True, SOFTCAP=spec, WINDOW=spec, **shape))
    assert "griddepcontrol.wait" in k.asm["ptx"] and "prefetch.global.L2" in k.asm["ptx"]
